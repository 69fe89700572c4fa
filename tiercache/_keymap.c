/* Hash tables of 128-bit keys: the probing loops of tiercache/keymap.py (which owns the
   table and its accounting), and the repeat check of a request's keys (hashing.py).

   The table is a C-contiguous (capacity, 3) uint64 array of (lo, hi, state) records,
   capacity a power of two, `mask` = capacity - 1; state 0 is an empty slot, 1 a
   tombstone, row + 2 a live record; linear probing. A key's first slot is not its low
   bits: keys come from clients, and a tenant could send keys that share them to make
   every probe long. It is lo * a + hi * b with odd salts a, b the caller draws at random
   and keeps for the table's life (keys that collide under one pair of salts are unlikely
   to under another), mixed by murmur3's 64-bit finaliser, its top bits. Without the
   mixing (multiply-shift alone), a run of keys n * d maps onto a run of slots n * c for
   some salts: keys (n << 40, n) or (n, 2^63 - n) for n < 2,000 made runs of 90-400
   occupied slots in about one table of a hundred, where random keys make 10-20. Every
   function works on a whole batch with the GIL held: a 32k-token prompt's 2,048 keys
   take a few microseconds, less than releasing and taking it back. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { EMPTY = 0, GONE = 1, BASE = 2 };

typedef struct {
    uint64_t mask, a, b;
    int shift;
} Hash;

static int hash_of(Hash *hash, unsigned long long mask, unsigned long long a, unsigned long long b) {
    if (mask == 0 || (mask & (mask + 1)) != 0 || mask >= (unsigned long long)PY_SSIZE_T_MAX / 24)
        return PyErr_SetString(PyExc_ValueError, "mask must be a power of two less one"), -1;
    if (!(a & 1) || !(b & 1))
        return PyErr_SetString(PyExc_ValueError, "salts must be odd"), -1;
    hash->mask = mask, hash->a = a, hash->b = b;
    hash->shift = 64 - __builtin_popcountll(mask);
    return 0;
}

/* A key's first slot. */
static inline uint64_t home(const Hash *hash, uint64_t lo, uint64_t hi) {
    uint64_t h = lo * hash->a + hi * hash->b;
    h ^= h >> 33, h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h >> hash->shift & hash->mask;
}

/* The slot holding (lo, hi), or -1. A probe ends at an empty slot; one that has gone
   round the whole table (a table without one, which keymap.py never lets happen) too. */
static int64_t slot_of(const uint64_t *table, const Hash *hash, uint64_t lo, uint64_t hi) {
    uint64_t mask = hash->mask, at = home(hash, lo, hi);
    for (uint64_t step = 0; step <= mask; step++, at = (at + 1) & mask) {
        const uint64_t *record = table + 3 * at;
        if (record[2] == EMPTY)
            return -1;
        if (record[2] >= BASE && record[0] == lo && record[1] == hi)
            return (int64_t)at;
    }
    return -1;
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

static int check_table(const Py_buffer *table, Hash *hash, unsigned long long mask,
                       unsigned long long a, unsigned long long b) {
    if (hash_of(hash, mask, a, b) != 0)
        return -1;
    return check(table, (Py_ssize_t)(mask + 1), 24, "table");
}

PyDoc_STRVAR(find_doc, "find(table, mask, a, b, keys, slots, rows): for each (lo, hi) key of the "
             "uint64 (n, 2) array keys, its slot and row into the int64 arrays slots and rows "
             "(-1 and -1 where it is absent).");

static PyObject *find(PyObject *self, PyObject *args) {
    Py_buffer table, keys, slots, rows;
    unsigned long long mask, a, b;
    Hash hash;
    if (!PyArg_ParseTuple(args, "y*KKKy*w*w*", &table, &mask, &a, &b, &keys, &slots, &rows))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = keys.len / 16;
    if (check_table(&table, &hash, mask, a, b) == 0 && check(&keys, n, 16, "keys") == 0 &&
        check(&slots, n, 8, "slots") == 0 && check(&rows, n, 8, "rows") == 0) {
        const uint64_t *t = table.buf, *k = keys.buf;
        int64_t *s = slots.buf, *r = rows.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t at = slot_of(t, &hash, k[2 * i], k[2 * i + 1]);
            s[i] = at;
            r[i] = at < 0 ? -1 : (int64_t)t[3 * at + 2] - BASE;
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&table), PyBuffer_Release(&keys), PyBuffer_Release(&slots),
        PyBuffer_Release(&rows);
    return result;
}

PyDoc_STRVAR(get_doc, "get(table, mask, a, b, lo, hi): the row of one key, or -1.");

static PyObject *get(PyObject *self, PyObject *args) {
    Py_buffer table;
    unsigned long long mask, a, b, lo, hi;
    Hash hash;
    if (!PyArg_ParseTuple(args, "y*KKKKK", &table, &mask, &a, &b, &lo, &hi))
        return NULL;
    PyObject *result = NULL;
    if (check_table(&table, &hash, mask, a, b) == 0) {
        const uint64_t *t = table.buf;
        int64_t at = slot_of(t, &hash, lo, hi);
        result = PyLong_FromLongLong(at < 0 ? -1 : (long long)t[3 * at + 2] - BASE);
    }
    PyBuffer_Release(&table);
    return result;
}

PyDoc_STRVAR(insert_doc, "insert(table, mask, a, b, keys, rows, looked_up) -> (position, why, "
             "tombstones taken): add each (lo, hi) key of keys with its row (int64, >= 0). "
             "Every key must be absent and distinct: else nothing is changed and position "
             "names the first key that is not, why 1 if the table holds it, 2 if it repeats "
             "an earlier key of the batch; (-1, 0, t) when all went in. With looked_up, the "
             "caller knows every key to be absent: only repeats are looked for. The table "
             "must have a free slot for each key.");

static PyObject *insert(PyObject *self, PyObject *args) {
    Py_buffer table, keys, rows;
    unsigned long long mask, a, b;
    int looked_up;
    Hash hash;
    if (!PyArg_ParseTuple(args, "w*KKKy*y*p", &table, &mask, &a, &b, &keys, &rows, &looked_up))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = keys.len / 16, position = -1, taken = 0, done = 0;
    int why = 0;
    uint64_t *written = NULL;  /* the slots taken, each with what it held: to undo */
    if (check_table(&table, &hash, mask, a, b) != 0 || check(&keys, n, 16, "keys") != 0 ||
        check(&rows, n, 8, "rows") != 0)
        goto end;
    uint64_t *t = table.buf;
    const uint64_t *k = keys.buf;
    const int64_t *r = rows.buf;
    for (Py_ssize_t i = 0; i < n && !looked_up; i++) {
        if (slot_of(t, &hash, k[2 * i], k[2 * i + 1]) >= 0) {
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
        uint64_t lo = k[2 * done], hi = k[2 * done + 1], at = home(&hash, lo, hi), step = 0;
        /* a repeat of a key placed earlier in the batch meets it before any free slot:
           that key took the first free slot on their common path */
        for (; t[3 * at + 2] >= BASE && step <= mask; at = (at + 1) & mask, step++) {
            if (t[3 * at] == lo && t[3 * at + 1] == hi) {
                position = done, why = 2;
                break;
            }
        }
        if (!why && step > mask) {
            PyErr_SetString(PyExc_ValueError, "the table has no free slot left");
            why = -1;
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
        if (why < 0)
            goto end;
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
    Hash hash;
    if (!PyArg_ParseTuple(args, "w*Ky*", &table, &mask, &slots))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = slots.len / 8, cleared = 0;
    if (check_table(&table, &hash, mask, 1, 1) == 0 && check(&slots, n, 8, "slots") == 0) {
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

PyDoc_STRVAR(first_repeat_doc, "first_repeat(keys, a, b) -> (first, repeat) or None: the "
             "earliest key of the uint64 (n, 2) array keys that repeats an earlier one, and "
             "where that one is; None if all are distinct.");

static PyObject *first_repeat(PyObject *self, PyObject *args) {
    Py_buffer keys;
    unsigned long long a, b;
    if (!PyArg_ParseTuple(args, "y*KK", &keys, &a, &b))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = keys.len / 16, capacity = 16;
    int64_t *seen = NULL;  /* a table of positions in keys, at most half full; -1: empty */
    Hash hash;
    while (capacity < 2 * n)
        capacity *= 2;
    if (check(&keys, n, 16, "keys") != 0 || hash_of(&hash, (unsigned long long)capacity - 1, a, b) != 0)
        goto end;
    seen = PyMem_Malloc(sizeof(int64_t) * (size_t)capacity);
    if (seen == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    memset(seen, 0xff, sizeof(int64_t) * (size_t)capacity);
    const uint64_t *k = keys.buf;
    Py_ssize_t first = -1, repeat = -1;
    for (Py_ssize_t i = 0; i < n && repeat < 0; i++) {
        uint64_t lo = k[2 * i], hi = k[2 * i + 1], at = home(&hash, lo, hi);
        for (; seen[at] >= 0; at = (at + 1) & hash.mask) {
            if (k[2 * seen[at]] == lo && k[2 * seen[at] + 1] == hi) {
                first = (Py_ssize_t)seen[at], repeat = i;
                break;
            }
        }
        seen[at] = i;
    }
    result = repeat < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nn)", first, repeat);
end:
    PyMem_Free(seen);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"first_repeat", first_repeat, METH_VARARGS, first_repeat_doc},
    {"find", find, METH_VARARGS, find_doc},
    {"get", get, METH_VARARGS, get_doc},
    {"insert", insert, METH_VARARGS, insert_doc},
    {"delete", delete, METH_VARARGS, delete_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiercache._keymap",
    .m_doc = "Hash tables of 128-bit keys (see _keymap.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__keymap(void) { return PyModule_Create(&module); }
