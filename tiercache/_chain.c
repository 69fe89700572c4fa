/* A prompt's chained page keys (tiercache/hashing.py) in one loop: k_i = xxh3_128(k_{i-1} ||
   page i), as the canonical 16 bytes xxhash.xxh3_128_digest gives, and optionally each
   page's check c_i = xxh3_64(k_{i-1} || page i) under a seed. In Python each page cost a
   concatenation, a call and an append: 8,192 pages (a 128k-token prompt) took 1.0 ms of
   loop alone on the 2-core machine. The GIL is released while hashing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

#define KEY 16

/* chain(data, step, root, seed or None) -> (list of `len(data) // step` keys of 16 bytes,
   bytes of their uint64 checks (native order), or None without a seed). */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer data, root;
    Py_ssize_t step;
    PyObject *seed_object;
    if (!PyArg_ParseTuple(args, "y*ny*O", &data, &step, &root, &seed_object))
        return NULL;
    PyObject *result = NULL, *keys = NULL, *checks = NULL;
    unsigned char *digests = NULL, *input = NULL;
    int with_checks = seed_object != Py_None;
    unsigned long long seed = 0;
    if (with_checks) {
        seed = PyLong_AsUnsignedLongLong(seed_object);
        if (PyErr_Occurred())
            goto done;
    }
    if (step <= 0 || root.len != KEY) {
        PyErr_Format(PyExc_ValueError, "a page is 1 byte or more and a root %d bytes: got %zd and %zd",
                     KEY, step, root.len);
        goto done;
    }
    Py_ssize_t pages = data.len / step;
    digests = PyMem_Malloc(pages * KEY + 1);
    input = PyMem_Malloc(KEY + step);
    if (with_checks)
        checks = PyBytes_FromStringAndSize(NULL, pages * (Py_ssize_t)sizeof(uint64_t));
    if (digests == NULL || input == NULL || (with_checks && checks == NULL)) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    uint64_t *check_out = with_checks ? (uint64_t *)PyBytes_AS_STRING(checks) : NULL;
    const unsigned char *pages_in = data.buf;
    Py_BEGIN_ALLOW_THREADS
    memcpy(input, root.buf, KEY);
    for (Py_ssize_t i = 0; i < pages; i++) {
        memcpy(input + KEY, pages_in + i * step, step);
        if (check_out != NULL)
            check_out[i] = XXH3_64bits_withSeed(input, KEY + step, seed);
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits(input, KEY + step));
        memcpy(digests + i * KEY, canonical.digest, KEY);
        memcpy(input, canonical.digest, KEY);  /* the next page chains on this key */
    }
    Py_END_ALLOW_THREADS
    keys = PyList_New(pages);
    if (keys == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < pages; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)digests + i * KEY, KEY);
        if (key == NULL)
            goto done;
        PyList_SET_ITEM(keys, i, key);
    }
    result = PyTuple_Pack(2, keys, with_checks ? checks : Py_None);
done:
    PyMem_Free(digests);
    PyMem_Free(input);
    Py_XDECREF(keys);
    Py_XDECREF(checks);
    PyBuffer_Release(&data);
    PyBuffer_Release(&root);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(data, step, root, seed): the chained xxh3-128 keys of data's whole pages of step "
     "bytes after root, and their xxh3-64 checks under seed (None: no checks)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
