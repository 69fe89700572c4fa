/* A CPU kept out of idle (the daemon's `spin` setting, service/cpus.py): a loop of pause
   instructions, with the GIL released, until the caller clears its flag. The caller has
   pinned its thread to the CPU and given it the lowest priority (SCHED_IDLE) first, so any
   other thread that wakes there takes the CPU at once. A virtual CPU that never halts is
   not taken off its core by the host: the daemon's threads that wake on it skip the
   wake-up of an idle CPU and find their caches as they left them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() do {} while (0)
#endif

static PyObject *spin(PyObject *self, PyObject *args) {
    Py_buffer flag;
    if (!PyArg_ParseTuple(args, "w*", &flag))
        return NULL;
    if (flag.len < 1) {
        PyBuffer_Release(&flag);
        return PyErr_Format(PyExc_ValueError, "the flag must be a writable buffer of one byte or more");
    }
    unsigned char *on = flag.buf;
    Py_BEGIN_ALLOW_THREADS
    while (__atomic_load_n(on, __ATOMIC_RELAXED))
        RELAX();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&flag);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"spin", spin, METH_VARARGS,
     "spin(flag): busy-wait, the GIL released, until flag[0] is 0."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_spin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
