/* The probing loops of tiercache/keymap.py, which owns the table and its accounting.

   The table is a C-contiguous (capacity, 3) uint64 array of (lo, hi, state) records,
   capacity a power of two, `mask` = capacity - 1; state 0 is an empty slot, 1 a
   tombstone, row + 2 a live record. A key's first slot is its low half & mask, then
   linear probing. Every function works on a whole batch with the GIL held: a 32k-token
   prompt's 2,048 keys take a few microseconds, less than releasing and taking it back. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { EMPTY = 0, GONE = 1, BASE = 2 };

/* The slot holding (lo, hi), or -1. */
static int64_t slot_of(const uint64_t *table, uint64_t mask, uint64_t lo, uint64_t hi) {
    for (uint64_t at = lo & mask;; at = (at + 1) & mask) {
        const uint64_t *record = table + 3 * at;
        if (record[2] == EMPTY)
            return -1;
        if (record[2] >= BASE && record[0] == lo && record[1] == hi)
            return (int64_t)at;
    }
}

/* Buffers as the argument formats y* (read-only) and w* (writable) give them: each
   must be C-contiguous and hold `count` items of `size` bytes. */
static int check(const Py_buffer *buffer, Py_ssize_t count, Py_ssize_t size, const char *name) {
    if (buffer->len != count * size) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, buffer->len,
                     count * size);
        return -1;
    }
    return 0;
}

static int check_table(const Py_buffer *table, uint64_t mask) {
    if (mask == 0 || (mask & (mask + 1)) != 0)
        return PyErr_SetString(PyExc_ValueError, "mask must be a power of two less one"), -1;
    return check(table, (Py_ssize_t)(mask + 1), 24, "table");
}

PyDoc_STRVAR(find_doc, "find(table, mask, keys, slots, rows): for each (lo, hi) key of the "
             "uint64 (n, 2) array keys, its slot and row into the int64 arrays slots and rows "
             "(-1 and -1 where it is absent).");

static PyObject *find(PyObject *self, PyObject *args) {
    Py_buffer table, keys, slots, rows;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*Ky*w*w*", &table, &mask, &keys, &slots, &rows))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = keys.len / 16;
    if (check_table(&table, mask) == 0 && check(&keys, n, 16, "keys") == 0 &&
        check(&slots, n, 8, "slots") == 0 && check(&rows, n, 8, "rows") == 0) {
        const uint64_t *t = table.buf, *k = keys.buf;
        int64_t *s = slots.buf, *r = rows.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t at = slot_of(t, mask, k[2 * i], k[2 * i + 1]);
            s[i] = at;
            r[i] = at < 0 ? -1 : (int64_t)t[3 * at + 2] - BASE;
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&table), PyBuffer_Release(&keys), PyBuffer_Release(&slots),
        PyBuffer_Release(&rows);
    return result;
}

PyDoc_STRVAR(get_doc, "get(table, mask, lo, hi): the row of one key, or -1.");

static PyObject *get(PyObject *self, PyObject *args) {
    Py_buffer table;
    unsigned long long mask, lo, hi;
    if (!PyArg_ParseTuple(args, "y*KKK", &table, &mask, &lo, &hi))
        return NULL;
    PyObject *result = NULL;
    if (check_table(&table, mask) == 0) {
        const uint64_t *t = table.buf;
        int64_t at = slot_of(t, mask, lo, hi);
        result = PyLong_FromLongLong(at < 0 ? -1 : (long long)t[3 * at + 2] - BASE);
    }
    PyBuffer_Release(&table);
    return result;
}

PyDoc_STRVAR(insert_doc, "insert(table, mask, keys, rows, looked_up) -> (position, why, "
             "tombstones taken): add each (lo, hi) key of keys with its row (int64, >= 0). "
             "Every key must be absent and distinct: else nothing is changed and position "
             "names the first key that is not, why 1 if the table holds it, 2 if it repeats "
             "an earlier key of the batch; (-1, 0, t) when all went in. With looked_up, the "
             "caller knows every key to be absent: only repeats are looked for. The table "
             "must have a free slot for each key.");

static PyObject *insert(PyObject *self, PyObject *args) {
    Py_buffer table, keys, rows;
    unsigned long long mask;
    int looked_up;
    if (!PyArg_ParseTuple(args, "w*Ky*y*p", &table, &mask, &keys, &rows, &looked_up))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = keys.len / 16, position = -1, taken = 0, done = 0;
    int why = 0;
    uint64_t *written = NULL;  /* the slots taken, each with what it held: to undo */
    if (check_table(&table, mask) != 0 || check(&keys, n, 16, "keys") != 0 ||
        check(&rows, n, 8, "rows") != 0)
        goto end;
    uint64_t *t = table.buf;
    const uint64_t *k = keys.buf;
    const int64_t *r = rows.buf;
    for (Py_ssize_t i = 0; i < n && !looked_up; i++) {
        if (slot_of(t, mask, k[2 * i], k[2 * i + 1]) >= 0) {
            position = i, why = 1;
            goto done;
        }
    }
    written = PyMem_Malloc(2 * sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (written == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    for (; done < n; done++) {
        uint64_t lo = k[2 * done], hi = k[2 * done + 1], at = lo & mask;
        /* a repeat of a key placed earlier in the batch meets it before any free slot:
           that key took the first free slot on their common path */
        for (; t[3 * at + 2] >= BASE; at = (at + 1) & mask) {
            if (t[3 * at] == lo && t[3 * at + 1] == hi) {
                position = done, why = 2;
                break;
            }
        }
        if (why)
            break;
        written[2 * done] = at, written[2 * done + 1] = t[3 * at + 2];
        taken += t[3 * at + 2] == GONE;
        t[3 * at] = lo, t[3 * at + 1] = hi, t[3 * at + 2] = (uint64_t)r[done] + BASE;
    }
    if (why) {  /* give every slot the batch took back what it held, latest first */
        for (Py_ssize_t i = done - 1; i >= 0; i--)
            t[3 * written[2 * i] + 2] = written[2 * i + 1];
        taken = 0;
    }
done:
    result = Py_BuildValue("nin", position, why, taken);
end:
    PyMem_Free(written);
    PyBuffer_Release(&table), PyBuffer_Release(&keys), PyBuffer_Release(&rows);
    return result;
}

PyDoc_STRVAR(delete_doc, "delete(table, mask, slots) -> tombstones cleared: mark the live "
             "records at slots (int64) deleted. A tombstone right before an empty slot ends "
             "every probe that reaches it as the empty slot would: it becomes empty, and so, "
             "in turn, do the tombstones before it.");

static PyObject *delete(PyObject *self, PyObject *args) {
    Py_buffer table, slots;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "w*Ky*", &table, &mask, &slots))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = slots.len / 8, cleared = 0;
    if (check_table(&table, mask) == 0 && check(&slots, n, 8, "slots") == 0) {
        uint64_t *t = table.buf;
        const int64_t *s = slots.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (s[i] < 0 || (uint64_t)s[i] > mask || t[3 * s[i] + 2] < BASE) {
                PyErr_Format(PyExc_ValueError, "slot %lld holds no record", (long long)s[i]);
                goto end;
            }
        }
        for (Py_ssize_t i = 0; i < n; i++)
            t[3 * s[i] + 2] = GONE;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t at = (uint64_t)s[i];
            if (t[3 * at + 2] != GONE || t[3 * ((at + 1) & mask) + 2] != EMPTY)
                continue;
            for (; t[3 * at + 2] == GONE; at = (at - 1) & mask, cleared++)
                t[3 * at + 2] = EMPTY;
        }
        result = PyLong_FromSsize_t(cleared);
    }
end:
    PyBuffer_Release(&table), PyBuffer_Release(&slots);
    return result;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, find_doc},
    {"get", get, METH_VARARGS, get_doc},
    {"insert", insert, METH_VARARGS, insert_doc},
    {"delete", delete, METH_VARARGS, delete_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiercache._keymap",
    .m_doc = "The probing loops of tiercache.keymap.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__keymap(void) { return PyModule_Create(&module); }
