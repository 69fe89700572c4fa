/* A word of shared memory that one process publishes and another waits on (tiercache/lane.py):
   a release store followed by a futex wake, and a wait that spins a while (yielding its
   CPU to any thread that wants it), then sleeps in the kernel until the word changes. The
   futex is not private: the word lies in a memfd both processes map, and the kernel keys
   such a futex by the file and offset, whatever address each process maps it at. The GIL
   is released while waiting. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>

/* The aligned 32-bit word at `offset` of a writable buffer, or NULL with an error set. */
static uint32_t *word_at(Py_buffer *buffer, Py_ssize_t offset) {
    if (offset < 0 || offset % 4 || offset + 4 > buffer->len || ((uintptr_t)buffer->buf) % 4) {
        PyErr_Format(PyExc_ValueError, "no aligned 32-bit word at offset %zd of %zd bytes", offset,
                     buffer->len);
        return NULL;
    }
    return (uint32_t *)((char *)buffer->buf + offset);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static PyObject *publish(PyObject *self, PyObject *args) {
    Py_buffer buffer;
    Py_ssize_t offset;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "w*nI", &buffer, &offset, &value))
        return NULL;
    uint32_t *word = word_at(&buffer, offset);
    if (word != NULL) {
        __atomic_store_n(word, value, __ATOMIC_RELEASE);
        syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    PyBuffer_Release(&buffer);
    if (word == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *load(PyObject *self, PyObject *args) {
    Py_buffer buffer;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*n", &buffer, &offset))
        return NULL;
    uint32_t *word = word_at(&buffer, offset);
    uint32_t value = word != NULL ? __atomic_load_n(word, __ATOMIC_ACQUIRE) : 0;
    PyBuffer_Release(&buffer);
    if (word == NULL)
        return NULL;
    return PyLong_FromUnsignedLong(value);
}

static PyObject *wait(PyObject *self, PyObject *args) {
    Py_buffer buffer;
    Py_ssize_t offset;
    unsigned int value;
    double timeout, spin;
    if (!PyArg_ParseTuple(args, "w*nIdd", &buffer, &offset, &value, &timeout, &spin))
        return NULL;
    uint32_t *word = word_at(&buffer, offset);
    if (word == NULL) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    if (!(timeout > 0))  /* NaN too */
        timeout = 0;
    if (timeout > 3600)  /* callers wait in slices: an hour bounds the timespec */
        timeout = 3600;
    uint32_t seen;
    Py_BEGIN_ALLOW_THREADS
    double start = now(), left;
    while ((seen = __atomic_load_n(word, __ATOMIC_ACQUIRE)) == value && now() - start < spin)
        sched_yield();  /* a CPU that others need goes to them: the other end may be one */
    while (seen == value && (left = timeout - (now() - start)) > 0) {
        struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        syscall(SYS_futex, word, FUTEX_WAIT, value, &ts, NULL, 0);  /* EAGAIN, EINTR, ETIMEDOUT: look again */
        seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buffer);
    return PyLong_FromUnsignedLong(seen);
}

static PyMethodDef methods[] = {
    {"publish", publish, METH_VARARGS,
     "publish(buffer, offset, value): store value into the word (release) and wake its waiters."},
    {"load", load, METH_VARARGS, "load(buffer, offset) -> the word's value (acquire)."},
    {"wait", wait, METH_VARARGS,
     "wait(buffer, offset, value, timeout, spin) -> the word's value once it is not `value`, or "
     "`value` after `timeout` seconds; spins `spin` seconds before sleeping, the GIL released."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lane", NULL, -1, methods};

PyMODINIT_FUNC PyInit__lane(void) { return PyModule_Create(&module); }
