/* The page index's probe (tiers/page_index.py) in C: find each fingerprint's slot.
 *
 * Why: the numpy probe runs a dozen small array operations per round, and several of them
 * release the GIL. Beside busy threads (the tier's readers finishing their runs) each
 * release risks waiting for the GIL to come back: a 32-key lookup took 5 ms beside one
 * spinning Python thread instead of 40 us. Here a request's keys are probed in one call
 * that keeps the GIL (a few microseconds); only batches of thousands of keys (start-up,
 * a pack's table) let other threads run meanwhile. page_index.py falls back to numpy
 * without this extension; tests/tiers/test_page_index.py runs both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* page_index._MIX and page_index._MULTIPLIER: a slot's home must match the numpy probe's */
#define MIX 0xC2B2AE3D27D4EB4FULL
#define MULTIPLIER 0x9E3779B97F4A7C15ULL
#define EMPTY (-1)
#define RELEASE_GIL_AT 4096     /* keys: below this, releasing costs more than it lets run */

static int get(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     name, view->len, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* probe(hi, lo, loc, fps, found, bits): found[i] = the slot holding fps[i], or -1 */
static PyObject *probe(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *objs[5];
    int bits;
    if (!PyArg_ParseTuple(args, "OOOOOi", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &bits))
        return NULL;
    static const char *names[5] = {"hi", "lo", "loc", "fps", "found"};
    static const Py_ssize_t sizes[5] = {8, 8, 8, 16, 8};
    Py_buffer v[5];
    int got = 0;
    for (; got < 5; got++)
        if (get(objs[got], &v[got], sizes[got], got == 4, names[got]) < 0)
            goto done;
    Py_ssize_t slots = v[0].len / 8, n = v[3].len / 16;
    if (bits < 1 || bits > 62 || slots != ((Py_ssize_t)1 << bits) || v[1].len != v[0].len ||
            v[2].len != v[0].len || v[4].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "probe: hi, lo and loc must have 2**bits slots and found one per fingerprint");
        goto done;
    }
    const uint64_t *hi = v[0].buf, *lo = v[1].buf, *fps = v[3].buf;
    const int64_t *loc = v[2].buf;
    int64_t *found = v[4].buf;
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    PyThreadState *released = n >= RELEASE_GIL_AT ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a = fps[2 * i], b = fps[2 * i + 1];
        uint64_t at = (((a * MIX) ^ b) * MULTIPLIER) >> (64 - bits);
        found[i] = -1;
        /* the table is never full (page_index.MAX_LOAD), so a probe meets an empty slot */
        for (;; at = (at + 1) & mask) {
            if (loc[at] == EMPTY)
                break;
            if (loc[at] >= 0 && hi[at] == a && lo[at] == b) {
                found[i] = (int64_t)at;
                break;
            }
        }
    }
    if (released)
        PyEval_RestoreThread(released);
done:
    while (got-- > 0)
        PyBuffer_Release(&v[got]);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS,
     "probe(hi, lo, loc, fps, found, bits): the slot of each fingerprint into found (-1: absent)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hybridkv.tiers._page_probe",
    "The page index's probe in C (see page_index.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__page_probe(void) {
    return PyModule_Create(&module);
}
