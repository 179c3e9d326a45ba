/* tierkv._fingerprints: the controller's key fingerprints (tierkv.controller.keytable) in one
 * pass over the keys.
 *
 * fill(keys, out) -> bool
 *
 * ``keys``: n 32-byte keys, concatenated (a buffer of n * 32 bytes); ``out``: a writable
 * buffer of n * 8 bytes (a numpy uint64 array), filled with each key's 62-bit non-zero
 * fingerprint. Returns whether every key has the first key's namespace digest (its first
 * 16 bytes; False for no keys), which a full report's per-namespace counts need. The
 * fingerprints are bit for bit what keytable.fingerprints_numpy computes: with the key's
 * four little-endian 64-bit words k0..k3,
 *
 *     h = k2 ^ (k0 * M1) ^ (k3 * M2) ^ (k1 * M3); h ^= h >> 31; h *= M2; h ^= h >> 29;
 *     fingerprint = (h >> 2) | 1
 *
 * numpy needs a dozen passes over the keys and as many temporary arrays for a full report
 * of a million keys (about 25 ms on the CI machine type); this loop reads them once. The
 * GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_SIZE 32
#define M1 0x9E3779B97F4A7C15ULL
#define M2 0xBF58476D1CE4E5B9ULL
#define M3 0x94D049BB133111EBULL
#define TIER_BITS 2

static inline uint64_t
word(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Fill out; 1 when every key's first 16 bytes equal the first key's. */
static int
fill_all(const unsigned char *keys, uint64_t *out, size_t n)
{
    uint64_t ns0 = n ? word(keys) : 0, ns1 = n ? word(keys + 8) : 0, differ = 0;
    for (size_t i = 0; i < n; i++, keys += KEY_SIZE) {
        differ |= (word(keys) ^ ns0) | (word(keys + 8) ^ ns1);
        uint64_t h = word(keys + 16) ^ (word(keys) * M1) ^ (word(keys + 24) * M2) ^
                     (word(keys + 8) * M3);
        h ^= h >> 31;
        h *= M2;
        h ^= h >> 29;
        out[i] = (h >> TIER_BITS) | 1;
    }
    return n && !differ;
}

static PyObject *
fill(PyObject *self, PyObject *args)
{
    Py_buffer k, o;
    if (!PyArg_ParseTuple(args, "y*w*", &k, &o))
        return NULL;
    PyObject *result = NULL;
    if (k.len % KEY_SIZE) {
        PyErr_Format(PyExc_ValueError, "keys must be %d bytes each", KEY_SIZE);
        goto done;
    }
    size_t n = (size_t)k.len / KEY_SIZE;
    if ((size_t)o.len != n * 8 || ((uintptr_t)o.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "out must be %zu aligned bytes (8 per key)", n * 8);
        goto done;
    }
    int one;
    Py_BEGIN_ALLOW_THREADS
    one = fill_all(k.buf, o.buf, n);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(one);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&k);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(keys, out) -> bool: each 32-byte key's fingerprint into out (8 bytes each); "
     "whether all keys share the first key's namespace."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierkv._fingerprints", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__fingerprints(void)
{
    return PyModule_Create(&module);
}
