/* tierkv._streamcopy: one copy between two strided arrays, written with non-temporal stores.
 *
 * copy(dst, src) -> bool
 *
 * dst and src export the buffer protocol with strides (numpy arrays of any strides; dst
 * writable) and have the same shape and the same item size. The copy goes by contiguous
 * runs (the innermost dimensions that are contiguous in both); each run of 256 bytes or
 * more is written with non-temporal ("streaming") stores on x86-64, which write whole cache
 * lines to memory without reading them first and without evicting the caller's working
 * set. A plain memcpy reads every destination line before writing it (a third of its
 * memory traffic) and leaves the copied bytes in the caches. Measured here (2 MiB chunks
 * between an engine's array and a shared-memory pool, caches cold): 16-18 GB/s against
 * glibc memcpy's 11-13, in both directions. A KV chunk's copy is read next by another
 * process (a store into the pool) or by the forward pass of a prompt far larger than the
 * caches (a load), so caching its lines buys nothing.
 *
 * Returns False, having copied nothing, when the arrays' contiguous runs are shorter than
 * 64 bytes (a transposed view: numpy's own strided loop is the better copy there) or when
 * the byte ranges they span overlap (numpy copies overlapping arrays correctly; two
 * interleaved views that share no element also land there). Raises ValueError for arrays
 * that do not match, TypeError for objects without strided buffers (a torch tensor: hand
 * over its numpy view), BufferError for a read-only dst. On other architectures every run
 * is a memcpy.
 *
 * copy_blocks(dst, src, axis, runs) -> bool
 *
 * The same copy for blocks picked along one axis: for every (j, b, count) row of runs (an
 * int64 array), src's blocks b..b+count-1 along ``axis`` into dst's j..j+count-1 (a KV
 * chunk gathered from, or scattered to, an engine's paged cache: every block of a chunk in
 * one call, where a call per run of blocks cost a few microseconds of Python each, several
 * times that with the interpreter's data out of the caches after each copy). Every row is
 * checked against both shapes before anything is copied (IndexError); False as for copy(),
 * decided on a one-block slice.
 *
 * The GIL is released during the copy (a chunk takes 0.1 to 1 ms), as numpy's copies do;
 * the buffers stay held until the copy has ended. A store fence ends every copy, so the
 * bytes are visible to other cores (a server that reads the chunk after the commit) before
 * the call returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_stream.h"

#define MIN_RUN 64     /* shorter runs: numpy copies (False) */
#define MAX_DIMS 64

static run_copy stream = plain; /* set at import: the best this CPU has */

typedef struct {
    int n;                      /* outer dimensions, outermost first */
    Py_ssize_t shape[MAX_DIMS];
    Py_ssize_t dstride[MAX_DIMS];
    Py_ssize_t sstride[MAX_DIMS];
    size_t run;                 /* bytes per contiguous run */
} plan_t;

/* The byte range [lo, hi) a buffer's elements span (nonempty shape). */
static void
extent(const Py_buffer *b, const Py_ssize_t *strides, char **lo, char **hi)
{
    char *l = b->buf, *h = (char *)b->buf + b->itemsize;
    for (int k = 0; k < b->ndim; k++) {
        Py_ssize_t span = strides[k] * (b->shape[k] - 1);
        if (span < 0)
            l += span;
        else
            h += span;
    }
    *lo = l;
    *hi = h;
}

/* Fill plan for copying an array of ``ndim`` dimensions of ``shape`` (items of ``itemsize``
 * bytes) between the strides dstrides and sstrides; 0: nothing to copy, 1: ok, -1: runs
 * too short. No Python object is touched (callable without the GIL). */
static int
make_plan(int ndim, const Py_ssize_t *dims, const Py_ssize_t *dstrides,
          const Py_ssize_t *sstrides, Py_ssize_t itemsize, plan_t *plan)
{
    Py_ssize_t shape[MAX_DIMS], ds[MAX_DIMS], ss[MAX_DIMS];
    int n = 0;
    for (int k = 0; k < ndim; k++) {
        if (dims[k] == 0)
            return 0;
        if (dims[k] == 1)
            continue; /* any stride: never stepped */
        shape[n] = dims[k];
        ds[n] = dstrides[k];
        ss[n] = sstrides[k];
        n++;
    }
    /* The innermost dimensions contiguous in both become one run. */
    size_t run = (size_t)itemsize;
    while (n > 0 && ds[n - 1] == (Py_ssize_t)run && ss[n - 1] == (Py_ssize_t)run) {
        run *= (size_t)shape[n - 1];
        n--;
    }
    if (run < MIN_RUN)
        return -1;
    /* Merge outer dimensions that step as one (a dimension split in two by a view). */
    plan->n = 0;
    for (int k = 0; k < n; k++) {
        int m = plan->n - 1;
        if (m >= 0 && plan->dstride[m] == ds[k] * shape[k] && plan->sstride[m] == ss[k] * shape[k]) {
            plan->shape[m] *= shape[k];
            plan->dstride[m] = ds[k];
            plan->sstride[m] = ss[k];
            continue;
        }
        plan->shape[plan->n] = shape[k];
        plan->dstride[plan->n] = ds[k];
        plan->sstride[plan->n] = ss[k];
        plan->n++;
    }
    plan->run = run;
    return 1;
}

/* Copy by plan (no fence: the caller fences once after its last plan). */
static void
run_plan(char *dp, const char *sp, const plan_t *plan)
{
    run_copy copy_run = plan->run >= MIN_STREAM ? stream : plain;
    Py_ssize_t idx[MAX_DIMS];
    memset(idx, 0, sizeof(idx));
    for (;;) {
        copy_run(dp, sp, plan->run);
        int k = plan->n - 1;
        for (; k >= 0; k--) {
            dp += plan->dstride[k];
            sp += plan->sstride[k];
            if (++idx[k] < plan->shape[k])
                break;
            dp -= plan->dstride[k] * plan->shape[k];
            sp -= plan->sstride[k] * plan->shape[k];
            idx[k] = 0;
        }
        if (k < 0)
            break;
    }
}

static PyObject *
copy(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *result = NULL;
    Py_buffer d, s;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj))
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &d, PyBUF_STRIDES | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &s, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.ndim != s.ndim || d.itemsize != s.itemsize || d.ndim > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError,
                     "arrays do not match: %d dimensions of %zd bytes into %d of %zd (at most %d)",
                     s.ndim, s.itemsize, d.ndim, d.itemsize, MAX_DIMS);
        goto done;
    }
    for (int k = 0; k < d.ndim; k++) {
        if (d.shape[k] != s.shape[k]) {
            PyErr_Format(PyExc_ValueError, "shapes differ in dimension %d: %zd into %zd", k,
                         s.shape[k], d.shape[k]);
            goto done;
        }
    }
    plan_t plan;
    int made = make_plan(d.ndim, d.shape, d.strides, s.strides, d.itemsize, &plan);
    if (made == 0) {
        result = Py_True;
        goto done;
    }
    char *dlo, *dhi, *slo, *shi;
    extent(&d, d.strides, &dlo, &dhi);
    extent(&s, s.strides, &slo, &shi);
    if (made < 0 || (dlo < shi && slo < dhi)) {
        result = Py_False;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    run_plan(d.buf, s.buf, &plan);
    stream_fence(); /* the streamed lines are visible to every core from here */
    Py_END_ALLOW_THREADS
    result = Py_True;
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_XINCREF(result);
    return result;
}

/* copy_blocks(dst, src, axis, runs) -> bool: for every row (j, b, m) of runs (int64,
 * three per row), dst[..., j:j+m, ...] = src[..., b:b+m, ...] along ``axis``; dst and src
 * have the same item size and the same shape but along ``axis``. Rows that continue the
 * one before (j and b both where it ended) are copied as one. Every index is checked
 * before anything is copied; False (nothing copied) as for copy(). */
static PyObject *
copy_blocks(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *runs_obj, *result = NULL;
    int axis;
    Py_buffer d, s, r;
    if (!PyArg_ParseTuple(args, "OOiO", &dst_obj, &src_obj, &axis, &runs_obj))
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &d, PyBUF_STRIDES | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &s, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (PyObject_GetBuffer(runs_obj, &r, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&s);
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.ndim != s.ndim || d.itemsize != s.itemsize || d.ndim > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError,
                     "arrays do not match: %d dimensions of %zd bytes into %d of %zd (at most %d)",
                     s.ndim, s.itemsize, d.ndim, d.itemsize, MAX_DIMS);
        goto done;
    }
    if (axis < 0 || axis >= d.ndim) {
        PyErr_Format(PyExc_ValueError, "axis %d is not one of the %d dimensions", axis, d.ndim);
        goto done;
    }
    for (int k = 0; k < d.ndim; k++) {
        if (k != axis && d.shape[k] != s.shape[k]) {
            PyErr_Format(PyExc_ValueError, "shapes differ in dimension %d: %zd into %zd", k,
                         s.shape[k], d.shape[k]);
            goto done;
        }
    }
    if (r.itemsize != 8 || r.format == NULL || strchr("qlQL", r.format[0]) == NULL ||
        r.format[1] != 0 || r.len % 24 != 0) {
        PyErr_SetString(PyExc_ValueError, "runs must be int64 triples (j, b, count)");
        goto done;
    }
    const int64_t *rows = r.buf;
    Py_ssize_t n = r.len / 24;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t j = rows[3 * i], b = rows[3 * i + 1], m = rows[3 * i + 2];
        if (j < 0 || b < 0 || m < 1 || j > d.shape[axis] - m || b > s.shape[axis] - m) {
            PyErr_Format(PyExc_IndexError,
                         "run %zd (%lld, %lld, %lld) is outside %zd and %zd blocks", i,
                         (long long)j, (long long)b, (long long)m, d.shape[axis],
                         s.shape[axis]);
            goto done;
        }
    }
    result = Py_True;
    if (n == 0 || d.len == 0)
        goto done;
    /* The plan of a one-block slice decides: its runs are the shortest any row gives. */
    Py_ssize_t dims[MAX_DIMS];
    memcpy(dims, d.shape, sizeof(Py_ssize_t) * (size_t)d.ndim);
    dims[axis] = 1;
    plan_t plan;
    char *dlo, *dhi, *slo, *shi;
    extent(&d, d.strides, &dlo, &dhi);
    extent(&s, s.strides, &slo, &shi);
    if (make_plan(d.ndim, dims, d.strides, s.strides, d.itemsize, &plan) < 0 ||
        (dlo < shi && slo < dhi)) {
        result = Py_False;
        goto done;
    }
    Py_ssize_t along_d = d.strides[axis], along_s = s.strides[axis];
    plan_t one = plan; /* a block at a time: always a plan (checked above) */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        int64_t j = rows[3 * i], b = rows[3 * i + 1], m = rows[3 * i + 2];
        for (i++; i < n && rows[3 * i] == j + m && rows[3 * i + 1] == b + m; i++)
            m += rows[3 * i + 2];
        dims[axis] = (Py_ssize_t)m;
        int made = make_plan(d.ndim, dims, d.strides, s.strides, d.itemsize, &plan);
        if (made > 0)
            run_plan((char *)d.buf + j * along_d, (const char *)s.buf + b * along_s, &plan);
        else if (made < 0) /* the block axis inside a short run: block by block */
            for (int64_t k = 0; k < m; k++)
                run_plan((char *)d.buf + (j + k) * along_d,
                         (const char *)s.buf + (b + k) * along_s, &one);
    }
    stream_fence();
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&r);
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_XINCREF(result);
    return result;
}

static PyObject *
kind(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(stream_kind(stream));
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src) -> bool: copy src into dst (same shape and item size, any strides) "
     "with non-temporal stores; False if their contiguous runs are too short or their "
     "byte ranges overlap (copied nothing: numpy's copy is the one for those)."},
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(dst, src, axis, runs) -> bool: for every (j, b, count) row of runs (int64), "
     "copy src's blocks b..b+count along axis into dst's j..j+count, as copy() does; every "
     "index checked first; False (nothing copied) as for copy()."},
    {"kind", kind, METH_NOARGS, "kind() -> str: the stores this CPU copies with."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierkv._streamcopy", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__streamcopy(void)
{
    stream = stream_pick();
    return PyModule_Create(&module);
}
