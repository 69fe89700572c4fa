/* Worker rows: the check of a request's rows (buffers.row_ids), the pieces of a staged
   copy (transfer.py), and row copies on the CPU between worker buffers and entry slots
   (tiercache/transfer.py's CpuTransfer), the CPU's counterpart of the GPU kernel (kernels.py) with the same tables: per buffer its
   base address, row stride, row bytes and offset inside an entry (int64, 4 x buffers);
   per entry a worker row and the address of its slot.

   Writes are non-temporal where they can be (16-byte aligned, 256 bytes and more): a
   plain store first reads each line it writes, so scattered copies moved half again the
   bytes they copied. 256 MiB in rows of 16 KiB, slots of 384 KiB, on the 2-core machine
   (benchmarks/tier_throughput.py, against one torch copy_ of the same bytes): stores
   0.66-0.85 by index_select and loads 0.70-0.86 by numpy before, 0.84-0.89 and 1.15-1.35
   so (the bulk copy writes plainly). A store walks buffer by buffer (the reads of one
   buffer's rows stay close), a load entry by entry (the reads of one slot follow each
   other). The GIL is released while it copies: the copy threads of a batch run side by
   side. The caller checks every row and slot: this only copies. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { BASE, STRIDE, WIDTH, OFFSET };

static inline void copy_row(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) == 0 && n >= 256) {
        size_t whole = n & ~(size_t)63;
        for (size_t i = 0; i < whole; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        if (whole < n)
            memcpy(dst + whole, src + whole, n - whole);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* An int64 C-contiguous buffer of `count` items (count < 0: any), or an error. */
static int int64s(PyObject *object, Py_buffer *view, Py_ssize_t count, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)
            || (count >= 0 && view->len != count * 8)) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous int64%s", what,
                     count >= 0 ? ", one per entry" : "");
        return -1;
    }
    return 0;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *table_object, *rows_object, *slots_object;
    int to_slots;
    if (!PyArg_ParseTuple(args, "OOOp", &table_object, &rows_object, &slots_object, &to_slots))
        return NULL;
    Py_buffer table_view, rows_view, slots_view;
    if (int64s(table_object, &table_view, -1, "the buffer table") < 0)
        return NULL;
    Py_ssize_t buffers = table_view.len / 32;
    if (table_view.len % 32) {
        PyBuffer_Release(&table_view);
        return PyErr_Format(PyExc_ValueError, "the buffer table must be 4 x buffers");
    }
    if (int64s(rows_object, &rows_view, -1, "rows") < 0) {
        PyBuffer_Release(&table_view);
        return NULL;
    }
    Py_ssize_t entries = rows_view.len / 8;
    if (int64s(slots_object, &slots_view, entries, "slot addresses") < 0) {
        PyBuffer_Release(&table_view);
        PyBuffer_Release(&rows_view);
        return NULL;
    }
    const int64_t *t = table_view.buf, *rows = rows_view.buf, *slots = slots_view.buf;
#define AT(field, b) t[(field) * buffers + (b)]
#define WORKER(e, b) ((char *)(uintptr_t)(AT(BASE, b) + rows[e] * AT(STRIDE, b)))
#define SLOT(e, b) ((char *)(uintptr_t)(slots[e] + AT(OFFSET, b)))
    Py_BEGIN_ALLOW_THREADS
    if (to_slots) {
        for (Py_ssize_t b = 0; b < buffers; b++)
            for (Py_ssize_t e = 0; e < entries; e++)
                copy_row(SLOT(e, b), WORKER(e, b), (size_t)AT(WIDTH, b));
    } else {
        for (Py_ssize_t e = 0; e < entries; e++)
            for (Py_ssize_t b = 0; b < buffers; b++)
                copy_row(WORKER(e, b), SLOT(e, b), (size_t)AT(WIDTH, b));
    }
#if defined(__SSE2__)
    _mm_sfence();  /* the non-temporal writes are visible before the caller goes on */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&table_view);
    PyBuffer_Release(&rows_view);
    PyBuffer_Release(&slots_view);
    Py_RETURN_NONE;
}

/* The first row of `ids` (int64) outside [0, limit), or, with `unique`, the first that
   repeats an earlier one: (position, 0 for out of range or 1 for a repeat), or None. One
   pass over a bitmap of the buffer's rows, for the rows of every load and store. */
static PyObject *check_rows(PyObject *self, PyObject *args) {
    PyObject *ids_object;
    long long limit;
    int unique;
    if (!PyArg_ParseTuple(args, "OLp", &ids_object, &limit, &unique))
        return NULL;
    Py_buffer ids_view;
    if (int64s(ids_object, &ids_view, -1, "row ids") < 0)
        return NULL;
    const int64_t *ids = ids_view.buf;
    Py_ssize_t n = ids_view.len / 8;
    uint64_t *seen = NULL;
    if (unique && n > 1 && limit > 0) {
        seen = PyMem_Calloc((size_t)(limit + 63) / 64, sizeof(uint64_t));
        if (seen == NULL) {
            PyBuffer_Release(&ids_view);
            return PyErr_NoMemory();
        }
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n && result == NULL; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= limit) {
            result = Py_BuildValue("(ni)", i, 0);
        } else if (seen != NULL) {
            uint64_t bit = (uint64_t)1 << (id & 63);
            if (seen[id >> 6] & bit)
                result = Py_BuildValue("(ni)", i, 1);
            seen[id >> 6] |= bit;
        }
    }
    PyMem_Free(seen);
    PyBuffer_Release(&ids_view);
    return result != NULL || PyErr_Occurred() ? result : Py_NewRef(Py_None);
}

/* The pieces a staged copy moves (transfer.py): `addresses` (int64) of slots `stride`
   bytes apart, ascending, cut into runs of consecutive slots of one slab (`slabs`, int64
   per slot, or None for one slab) and wherever a half of the ring (`per_half` slots)
   ends. Returns (starts, lengths) as bytes of int64 and the number of runs before the
   cuts, or None if the addresses are not ascending. Two passes over the slots: numpy
   took 35 us for 170 slots on the 2-core machine, about 90 on an H200 host, in the way
   of every staged copy's first bytes. */
static PyObject *pieces(PyObject *self, PyObject *args) {
    PyObject *addresses_object, *slabs_object;
    long long stride, per_half;
    if (!PyArg_ParseTuple(args, "OOLL", &addresses_object, &slabs_object, &stride, &per_half))
        return NULL;
    if (per_half < 1)
        return PyErr_Format(PyExc_ValueError, "a half of the ring holds at least one slot");
    Py_buffer a_view, s_view;
    if (int64s(addresses_object, &a_view, -1, "slot addresses") < 0)
        return NULL;
    Py_ssize_t n = a_view.len / 8;
    int slabs = slabs_object != Py_None;
    if (slabs && int64s(slabs_object, &s_view, n, "slabs") < 0) {
        PyBuffer_Release(&a_view);
        return NULL;
    }
    const int64_t *a = a_view.buf, *s = slabs ? s_view.buf : NULL;
#define BREAK(i) (a[i] != a[(i) - 1] + stride || (slabs && s[i] != s[(i) - 1]))
    Py_ssize_t count = n > 0, runs = n > 0;
    int ascending = 1;
    for (Py_ssize_t i = 1; i < n && ascending; i++) {
        ascending = a[i] > a[i - 1];
        int cut = BREAK(i);
        runs += cut;
        count += cut || i % per_half == 0;
    }
    PyObject *result = NULL;
    if (!ascending) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *starts = PyBytes_FromStringAndSize(NULL, count * 8);
        PyObject *lengths = PyBytes_FromStringAndSize(NULL, count * 8);
        if (starts != NULL && lengths != NULL) {
            int64_t *at = (int64_t *)PyBytes_AS_STRING(starts), *length = (int64_t *)PyBytes_AS_STRING(lengths);
            Py_ssize_t k = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (i == 0 || BREAK(i) || i % per_half == 0) {
                    if (k > 0)
                        length[k - 1] = i - at[k - 1];
                    at[k++] = i;
                }
            }
            if (k > 0)
                length[k - 1] = n - at[k - 1];
            result = Py_BuildValue("(OOn)", starts, lengths, runs);
        }
        Py_XDECREF(starts);
        Py_XDECREF(lengths);
    }
#undef BREAK
    PyBuffer_Release(&a_view);
    if (slabs)
        PyBuffer_Release(&s_view);
    return result;
}

static PyMethodDef methods[] = {
    {"check_rows", check_rows, METH_VARARGS,
     "check_rows(ids, limit, unique) -> (position, why) or None: the first of the int64 "
     "ids outside [0, limit) (why 0) or, if unique, repeating an earlier one (why 1)."},
    {"pieces", pieces, METH_VARARGS,
     "pieces(addresses, slabs, stride, per_half) -> (starts, lengths, runs) or None: the runs "
     "of ascending int64 slot addresses `stride` apart, of one slab each, cut every "
     "per_half slots (starts and lengths as bytes of int64); None if not ascending."},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(table, rows, slots, to_slots): row rows[i] of every buffer of `table` "
     "(int64 4 x buffers: base, stride, width, offset) to (or from) the slot at address "
     "slots[i] plus the buffer's offset."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
