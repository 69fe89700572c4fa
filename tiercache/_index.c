/* The index's per-entry loops of a load (tiercache/index.py): which of the rows a batch
   of keys looked up can serve the caller (Index.usable), and in which tier and slot each
   entry of a hit lies (Index.locate). numpy took a dozen calls over the whole batch for
   each (13 us for the 2,048 keys of a 32k-token prompt on the 2-core machine, several
   times that inside a daemon's call); each is one pass here. The caller passes the
   index's columns as they are; these only read them, and write the outputs it gives. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { TIER_DEVICE = 1, TIER_HOST = 2 };  /* tiercache/results.py's Tier (4: disk) */

/* A C-contiguous buffer of `count` items of `itemsize` bytes (count < 0: any), or an error. */
static int view_of(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count,
                   int writable, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len % itemsize
            || (count >= 0 && view->len != count * itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous, %zd bytes an item%s", what,
                     itemsize, count >= 0 ? ", one per row" : "");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(usable_doc,
    "usable(rows, out, tiers, sizes, stored, nbytes, checks, readable) -> (first, foreign, "
    "collisions): out[i] = rows[i] (int64, -1: the key is absent), or -1 where that entry "
    "is in none of the tiers `readable` (tiers: uint8 column, a bit mask each), is not "
    "`nbytes` long (sizes: int64 column) or, given checks (uint64, one per row, or None), "
    "has a stored check (uint64 column) that is not 0 and differs. Returns the first i "
    "with out[i] == -1 (len(rows) if none), and how many present entries were of another "
    "size and how many of another check.");

static PyObject *usable(PyObject *self, PyObject *args) {
    PyObject *rows_o, *out_o, *tiers_o, *sizes_o, *stored_o, *checks_o;
    long long nbytes;
    unsigned int readable;
    if (!PyArg_ParseTuple(args, "OOOOOLOI", &rows_o, &out_o, &tiers_o, &sizes_o, &stored_o,
                          &nbytes, &checks_o, &readable))
        return NULL;
    /* rows, out, tiers, sizes, stored checks and, unless None, the caller's checks */
    Py_buffer views[6];
    PyObject *objects[6] = {rows_o, out_o, tiers_o, sizes_o, stored_o, checks_o};
    const char *names[6] = {"rows", "out", "tiers", "sizes", "stored checks", "checks"};
    Py_ssize_t item[6] = {8, 8, 1, 8, 8, 8};
    int wanted = checks_o == Py_None ? 5 : 6, got = 0;
    PyObject *result = NULL;
    for (; got < wanted; got++) {  /* out and checks: one per row; sizes and stored: per index row */
        Py_ssize_t count = got == 0 || got == 2 ? -1 : got == 1 || got == 5 ? views[0].len / 8
                                                                             : views[2].len;
        if (view_of(objects[got], &views[got], item[got], count, got == 1, names[got]) < 0)
            goto end;
    }
    Py_ssize_t n = views[0].len / 8, capacity = views[2].len;
    const int64_t *r = views[0].buf, *size = views[3].buf;
    const uint8_t *tier = views[2].buf;
    const uint64_t *kept = views[4].buf, *check = wanted == 6 ? views[5].buf : NULL;
    int64_t *o = views[1].buf;
    Py_ssize_t first = n, foreign = 0, collisions = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = r[i];
        int ok = 0;
        if (row >= capacity) {
            PyErr_Format(PyExc_IndexError, "row %lld is past the index's %zd rows",
                         (long long)row, capacity);
            goto end;
        }
        if (row >= 0 && (tier[row] & readable)) {  /* a claimed entry is in no tier */
            if (size[row] != nbytes)
                foreign++;
            else if (check != NULL && kept[row] != 0 && kept[row] != check[i])
                collisions++;
            else
                ok = 1;
        }
        o[i] = ok ? row : -1;
        if (!ok && first == n)
            first = i;
    }
    result = Py_BuildValue("(nnn)", first, foreign, collisions);
end:
    while (got-- > 0)
        PyBuffer_Release(&views[got]);
    return result;
}

PyDoc_STRVAR(locate_doc,
    "locate(rows, tiers, host_slots, device_slots, device_ok, on_device, host, device, "
    "disk) -> (devices, disks): where each entry of rows (int64) is, from the index's "
    "columns (tiers: uint8 bit masks; host_slots and device_slots: int32). on_device[i] "
    "(bool) marks an entry in the device tier when device_ok; host[i] (int64) is its host "
    "slot if it is in the host tier and not on_device, else -1; device[:devices] (int64) "
    "are the device slots of the entries on_device, in order; disk[:disks] (int64) the "
    "positions of the entries in neither.");

static PyObject *locate(PyObject *self, PyObject *args) {
    PyObject *rows_o, *tiers_o, *host_col_o, *device_col_o, *on_o, *host_o, *device_o, *disk_o;
    int device_ok;
    if (!PyArg_ParseTuple(args, "OOOOpOOOO", &rows_o, &tiers_o, &host_col_o, &device_col_o,
                          &device_ok, &on_o, &host_o, &device_o, &disk_o))
        return NULL;
    Py_buffer views[8];
    PyObject *objects[8] = {rows_o, tiers_o, host_col_o, device_col_o, on_o, host_o, device_o, disk_o};
    const char *names[8] = {"rows", "tiers", "host slots", "device slots", "on_device", "host",
                            "device", "disk"};
    Py_ssize_t sizes[8] = {8, 1, 4, 4, 1, 8, 8, 8};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 8; got++) {
        Py_ssize_t count = got == 0 || got == 1 ? -1 : got < 4 ? views[1].len : views[0].len / 8;
        if (view_of(objects[got], &views[got], sizes[got], count, got >= 4, names[got]) < 0)
            goto end;
    }
    Py_ssize_t n = views[0].len / 8, capacity = views[1].len, devices = 0, disks = 0;
    const int64_t *rows = views[0].buf;
    const uint8_t *tiers = views[1].buf;
    const int32_t *host_col = views[2].buf, *device_col = views[3].buf;
    uint8_t *on = views[4].buf;
    int64_t *host = views[5].buf, *device = views[6].buf, *disk = views[7].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        if (row < 0 || row >= capacity) {
            PyErr_Format(PyExc_IndexError, "row %lld is not one of the index's %zd rows",
                         (long long)row, capacity);
            goto end;
        }
        on[i] = device_ok && (tiers[row] & TIER_DEVICE);
        host[i] = !on[i] && (tiers[row] & TIER_HOST) ? host_col[row] : -1;
        if (on[i])
            device[devices++] = device_col[row];
        else if (host[i] < 0)
            disk[disks++] = i;
    }
    result = Py_BuildValue("(nn)", devices, disks);
end:
    while (got-- > 0)
        PyBuffer_Release(&views[got]);
    return result;
}

static PyMethodDef methods[] = {
    {"usable", usable, METH_VARARGS, usable_doc},
    {"locate", locate, METH_VARARGS, locate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiercache._index",
    .m_doc = "The index's per-entry loops of a load (see _index.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
