/* tierkv._fingerprints: the controller's key fingerprints (tierkv.controller.keytable) in one
 * pass over the keys, its lookups' two searches (tierkv.controller.holders,
 * tierkv.controller.keytable) in one call per batch, and the sort and merges of its full
 * reports.
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
 *
 * namespaces(keys, index, cap) -> list | None
 *
 * The distinct namespace digests (the first 16 bytes) of ``keys`` (n 32-byte keys,
 * concatenated), as bytes, in the order they first appear, and per key the position of its
 * own in that list, into ``index`` (a writable buffer of n int64s); None where there are
 * more than ``cap`` distinct ones (the caller then groups them with numpy). One pass over
 * the keys with a small open-addressing table (a key of the same namespace as the key
 * before skips it): an engine with several tensor-parallel ranks, or tenants with cache
 * salts, reports keys of several namespaces at once, which numpy's ``unique`` over the
 * digests' rows took 0.75 to 1.3 s to group for a million keys.
 *
 * match_slots(arr, starts, shift, want, seen, out, count) -> int
 *
 * The holder filter's search: ``arr`` a sorted uint64 array of entries (``high bits | slot``,
 * the slot in the low 16 bits), ``starts`` its directory (int64, bucket b's entries are
 * ``[starts[b], starts[b + 1])`` with b an entry's top bits, ``>> shift``; an empty buffer:
 * no directory, the whole array is searched), ``want`` uint64 values with the slot bits
 * clear. For every entry whose high bits equal a wanted value, its slot, unless ``seen``
 * (uint8, one per slot) marks it already, is marked and appended to ``out`` (int64, one per
 * slot) after the first ``count``; returns the new count. The same as numpy's searchsorted
 * and a walk along the matches, in one pass: numpy's version is a dozen calls per step of
 * the search for a 512-key batch, 0.16 ms of a lookup's 0.33 ms on the CI machine type.
 * Each key's bucket is prefetched a few keys ahead, so the misses of several keys overlap.
 *
 * probe(slots, shift, fps, out)
 *
 * A key table's lookup: ``slots`` its uint64 array (``fingerprint << 2 | tier``, 0 empty,
 * 1 deleted), ``shift`` its home shift; for each fingerprint of ``fps`` (uint64) the tier
 * it is held at into ``out`` (int8), -1 where absent: linear probing from the home slot
 * ``fp >> shift`` to the fingerprint or an empty slot (the array ends with empty slots).
 *
 * place(entries, slots, shift, by_tier) -> (live, last)
 *
 * A full report's table: ``entries`` (uint64, ``fingerprint << 2 | tier``) sorted, placed
 * into an empty table's ``slots``, each at the larger of its home and the previous entry's
 * slot + 1 (what linear probing gives in sorted order), a fingerprint that repeats the
 * previous one left out; ``by_tier`` (4 int64) counts the entries placed by tier. Returns
 * how many were placed and the last slot needed (-1: none); slots past the array are not
 * written, so a caller whose array was too short makes a longer one and places again. The
 * same as keytable's numpy passes (repeats, homes, a running maximum, a scatter, counts).
 *
 * sort(arr)
 *
 * ``arr`` (a contiguous uint64 array) sorted in place: a least-significant-digit radix sort,
 * eight passes of one byte each (a pass whose byte is the same in every value is skipped),
 * the eight counts taken in one pass first, a scratch array of the same size allocated and
 * freed here, the GIL released. A full report sorts a million entries before placing them:
 * numpy's sort took 51 ms of that report's 57 on an AVX-512 AMD EPYC VM (its vectorized
 * quicksort stores through AVX-512's compress instruction, which that Zen 4 CPU runs
 * slowly; numpy's AVX2 sort took 11 ms there), this one 13 ms: it reads and writes every
 * value once a pass, whatever the values and the CPU.
 *
 * merge(parts, live, out) -> int
 *
 * The holder filter's merge (tierkv.controller.holders.merge_parts): ``parts`` a sequence of
 * sorted uint64 arrays of entries (slot in the low 16 bits), ``live`` one byte per slot
 * (non-zero: live). Writes into ``out`` (uint64, room for every part's entries) all entries
 * of live slots in sorted order, an entry equal to the one before left out; returns how
 * many. A k-way merge that takes a run from the part with the smallest head as long as its
 * entries stay at or below every other part's head (the big sorted array between a report's
 * entries: long runs, one comparison per entry). numpy's version filtered each part into a
 * copy (slot array, mask, kept entries), concatenated them, sorted and deduplicated: about
 * six temporaries the size of the filter (5 GB for 100 M entries) and 3 to 4 s a merge of
 * a 100 M-entry filter on the CI machine type, most of it the kernel's page faults.
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

/* The number of 32-byte keys in k, into *n, where out holds 8 aligned bytes per key;
 * 0 with a ValueError naming out (as ``what``) otherwise. */
static int
count_keys(const Py_buffer *k, const Py_buffer *out, const char *what, size_t *n)
{
    if (k->len % KEY_SIZE) {
        PyErr_Format(PyExc_ValueError, "keys must be %d bytes each", KEY_SIZE);
        return 0;
    }
    *n = (size_t)k->len / KEY_SIZE;
    if ((size_t)out->len != *n * 8 || ((uintptr_t)out->buf & 7)) {
        PyErr_Format(PyExc_ValueError, "%s must be %zu aligned bytes (8 per key)", what, *n * 8);
        return 0;
    }
    return 1;
}

static PyObject *
fill(PyObject *self, PyObject *args)
{
    Py_buffer k, o;
    if (!PyArg_ParseTuple(args, "y*w*", &k, &o))
        return NULL;
    PyObject *result = NULL;
    size_t n;
    if (!count_keys(&k, &o, "out", &n))
        goto done;
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

/* One namespace in namespaces()' table: its digest's two words and its position. */
typedef struct {
    uint64_t a, b;
    int64_t id; /* -1: an empty entry */
} ns_entry;

/* Group n keys by namespace; see namespaces' comment. Returns how many distinct ones, -1
 * past cap; first[j]: the first key of the j-th. */
static Py_ssize_t
group_namespaces(const unsigned char *keys, size_t n, int64_t *index, ns_entry *table,
                 size_t mask, size_t *first, size_t cap)
{
    size_t count = 0;
    uint64_t last_a = 0, last_b = 0;
    int64_t last = -1;
    for (size_t i = 0; i < n; i++, keys += KEY_SIZE) {
        uint64_t a = word(keys), b = word(keys + 8);
        if (last >= 0 && a == last_a && b == last_b) {
            index[i] = last;
            continue;
        }
        size_t h = (size_t)(((a ^ b) * M1) >> 32) & mask; /* digests are uniform already */
        while (table[h].id >= 0 && (table[h].a != a || table[h].b != b))
            h = (h + 1) & mask;
        if (table[h].id < 0) {
            if (count == cap)
                return -1;
            table[h].a = a;
            table[h].b = b;
            table[h].id = (int64_t)count;
            first[count++] = i;
        }
        last_a = a;
        last_b = b;
        last = table[h].id;
        index[i] = last;
    }
    return (Py_ssize_t)count;
}

static PyObject *
namespaces(PyObject *self, PyObject *args)
{
    Py_buffer k, ix;
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "y*w*n", &k, &ix, &cap))
        return NULL;
    PyObject *result = NULL;
    ns_entry *table = NULL;
    size_t *first = NULL;
    size_t n;
    if (!count_keys(&k, &ix, "index", &n))
        goto done;
    if (cap < 1 || cap > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "cap must be in [1, 2**20]");
        goto done;
    }
    size_t size = 1;
    while (size < 2 * (size_t)cap)
        size <<= 1; /* at most half full */
    table = PyMem_Malloc(size * sizeof(ns_entry));
    first = PyMem_Malloc((size_t)cap * sizeof(size_t));
    if (table == NULL || first == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < size; i++)
        table[i].id = -1;
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = group_namespaces(k.buf, n, ix.buf, table, size - 1, first, (size_t)cap);
    Py_END_ALLOW_THREADS
    if (count < 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = PyList_New(count);
    for (Py_ssize_t j = 0; result != NULL && j < count; j++) {
        PyObject *digest =
            PyBytes_FromStringAndSize((const char *)k.buf + first[j] * KEY_SIZE, 16);
        if (digest == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, j, digest);
    }
done:
    PyMem_Free(first);
    PyMem_Free(table);
    PyBuffer_Release(&ix);
    PyBuffer_Release(&k);
    return result;
}

#define SLOT_BITS 16
#define SLOTS (1 << SLOT_BITS)
#define LOW_MASK ((uint64_t)(SLOTS - 1))
#define AHEAD 8 /* keys whose buckets are prefetched ahead of the one searched */

/* The first index in [lo, hi) whose entry is >= want (hi when none). */
static inline size_t
lower_bound(const uint64_t *arr, size_t lo, size_t hi, uint64_t want)
{
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (arr[mid] < want)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static size_t
match_all(const uint64_t *arr, size_t n, const int64_t *starts, size_t buckets, unsigned shift,
          const uint64_t *want, size_t m, uint8_t *seen, int64_t *out, size_t count)
{
    for (size_t i = 0; i < m; i++) {
        size_t lo = 0, hi = n;
        if (buckets) {
            if (i + AHEAD < m) {
                uint64_t b = want[i + AHEAD] >> shift;
                if (b < buckets && starts[b] >= 0 && (size_t)starts[b] < n) {
                    const uint64_t *p = arr + starts[b];
                    __builtin_prefetch(p);
                    __builtin_prefetch(p + 8);
                    __builtin_prefetch(p + 16);
                    __builtin_prefetch(p + 24);
                }
            }
            uint64_t b = want[i] >> shift;
            if (b >= buckets)
                continue;
            /* Bounds from the directory, clamped to arr: never read outside it, whatever
               the directory holds (checking all of it would cost more than the search). */
            int64_t s0 = starts[b], s1 = starts[b + 1];
            lo = s0 < 0 ? 0 : (size_t)s0 > n ? n : (size_t)s0;
            hi = s1 < 0 ? 0 : (size_t)s1 > n ? n : (size_t)s1;
            if (lo > hi)
                continue;
        }
        for (size_t at = lower_bound(arr, lo, hi, want[i]); at < n; at++) {
            uint64_t e = arr[at];
            if ((e & ~LOW_MASK) != want[i])
                break;
            size_t slot = (size_t)(e & LOW_MASK);
            if (!seen[slot] && count < SLOTS) { /* a count the caller's seen does not
                                                     match must not write past out */
                seen[slot] = 1;
                out[count++] = (int64_t)slot;
            }
        }
    }
    return count;
}

static PyObject *
match_slots(PyObject *self, PyObject *args)
{
    Py_buffer a, st, w, sn, o;
    unsigned shift;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*y*Iy*w*w*n", &a, &st, &shift, &w, &sn, &o, &count))
        return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)a.len / 8, m = (size_t)w.len / 8;
    size_t buckets = st.len ? (size_t)st.len / 8 - 1 : 0;
    if (a.len % 8 || w.len % 8 || (st.len && (st.len % 8 || st.len < 16)) ||
        ((uintptr_t)a.buf | (uintptr_t)w.buf | (uintptr_t)st.buf | (uintptr_t)o.buf) & 7) {
        PyErr_SetString(PyExc_ValueError, "arr, starts, want and out must be aligned 8-byte arrays");
        goto done;
    }
    if (sn.len != SLOTS || o.len != SLOTS * 8 || count < 0 || count > SLOTS) {
        PyErr_Format(PyExc_ValueError, "seen and out must hold %d slots, count at most that",
                     SLOTS);
        goto done;
    }
    if (shift >= 64) { /* a key's bucket is want >> shift: one past the buckets is skipped */
        PyErr_SetString(PyExc_ValueError, "the directory's shift must be below 64");
        goto done;
    }
    size_t got;
    Py_BEGIN_ALLOW_THREADS
    got = match_all(a.buf, n, st.buf, buckets, shift, w.buf, m, sn.buf, o.buf, (size_t)count);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSize_t(got);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&sn);
    PyBuffer_Release(&w);
    PyBuffer_Release(&st);
    PyBuffer_Release(&a);
    return result;
}

static void
probe_all(const uint64_t *slots, size_t n, unsigned shift, const uint64_t *fps, size_t m,
          int8_t *out)
{
    for (size_t i = 0; i < m; i++) {
        if (i + AHEAD < m) {
            size_t ahead = (size_t)(fps[i + AHEAD] >> shift);
            if (ahead < n)
                __builtin_prefetch(slots + ahead);
        }
        int8_t tier = -1;
        for (size_t at = (size_t)(fps[i] >> shift); at < n; at++) {
            uint64_t e = slots[at];
            if (e == 0)
                break;
            if (e >> TIER_BITS == fps[i]) {
                tier = (int8_t)(e & ((1 << TIER_BITS) - 1));
                break;
            }
        }
        out[i] = tier;
    }
}

static PyObject *
probe(PyObject *self, PyObject *args)
{
    Py_buffer sl, f, o;
    unsigned shift;
    if (!PyArg_ParseTuple(args, "y*Iy*w*", &sl, &shift, &f, &o))
        return NULL;
    PyObject *result = NULL;
    if (sl.len % 8 || f.len % 8 || ((uintptr_t)sl.buf | (uintptr_t)f.buf) & 7 ||
        o.len != f.len / 8 || shift >= 64) {
        PyErr_SetString(PyExc_ValueError,
                        "slots and fps must be aligned 8-byte arrays, out one byte per fp");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    probe_all(sl.buf, (size_t)sl.len / 8, shift, f.buf, (size_t)f.len / 8, o.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&f);
    PyBuffer_Release(&sl);
    return result;
}

/* A table built from entries sorted by fingerprint (so by home): each goes to
 * max(home, previous slot + 1), the running maximum that linear probing gives in that order;
 * an entry whose fingerprint repeats the previous one is left out (the first is kept).
 * Writes only slots inside the array; returns the last slot an entry needs (-1: none), so
 * that a caller whose array was too short makes a longer one and places again. */
static Py_ssize_t
place_sorted(const uint64_t *entries, size_t m, uint64_t *slots, size_t n, unsigned shift,
             int64_t *by_tier, Py_ssize_t *live)
{
    Py_ssize_t last = -1, kept = 0;
    uint64_t prev = 0;
    for (size_t i = 0; i < m; i++) {
        uint64_t e = entries[i], fp = e >> TIER_BITS;
        if (kept && fp == prev)
            continue;
        Py_ssize_t at = (Py_ssize_t)(fp >> shift);
        if (at <= last)
            at = last + 1;
        if ((size_t)at < n)
            slots[at] = e;
        by_tier[e & ((1 << TIER_BITS) - 1)]++;
        last = at;
        prev = fp;
        kept++;
    }
    *live = kept;
    return last;
}

static PyObject *
place(PyObject *self, PyObject *args)
{
    Py_buffer en, sl, bt;
    unsigned shift;
    if (!PyArg_ParseTuple(args, "y*w*Iw*", &en, &sl, &shift, &bt))
        return NULL;
    PyObject *result = NULL;
    if (en.len % 8 || sl.len % 8 ||
        ((uintptr_t)en.buf | (uintptr_t)sl.buf | (uintptr_t)bt.buf) & 7 ||
        bt.len != 8 * (1 << TIER_BITS) || shift >= 64) {
        PyErr_SetString(PyExc_ValueError,
                        "entries and slots must be aligned 8-byte arrays, by_tier 4 int64s");
        goto done;
    }
    Py_ssize_t live = 0, last;
    Py_BEGIN_ALLOW_THREADS
    last = place_sorted(en.buf, (size_t)en.len / 8, sl.buf, (size_t)sl.len / 8, shift, bt.buf,
                        &live);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nn)", live, last);
done:
    PyBuffer_Release(&bt);
    PyBuffer_Release(&sl);
    PyBuffer_Release(&en);
    return result;
}

#define RADIX_BITS 8
#define RADIX (1u << RADIX_BITS)
#define RADIX_PASSES (64 / RADIX_BITS)

/* Sort a (n values) in place through scratch (n values); see sort's comment. */
static void
radix_sort(uint64_t *a, uint64_t *scratch, size_t n, size_t counts[RADIX_PASSES][RADIX])
{
    memset(counts, 0, sizeof(size_t) * RADIX_PASSES * RADIX);
    for (size_t i = 0; i < n; i++) {
        uint64_t v = a[i];
        for (unsigned p = 0; p < RADIX_PASSES; p++)
            counts[p][(v >> (p * RADIX_BITS)) & (RADIX - 1)]++;
    }
    uint64_t *src = a, *dst = scratch;
    for (unsigned p = 0; p < RADIX_PASSES; p++) {
        size_t *c = counts[p], at = 0;
        unsigned shift = p * RADIX_BITS;
        if (c[(src[0] >> shift) & (RADIX - 1)] == n)
            continue; /* every value has the first one's byte here: already in order */
        for (unsigned b = 0; b < RADIX; b++) {
            size_t k = c[b];
            c[b] = at;
            at += k;
        }
        for (size_t i = 0; i < n; i++) {
            uint64_t v = src[i];
            dst[c[(v >> shift) & (RADIX - 1)]++] = v;
        }
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, n * sizeof(uint64_t));
}

static PyObject *
sort(PyObject *self, PyObject *args)
{
    Py_buffer ar;
    if (!PyArg_ParseTuple(args, "w*", &ar))
        return NULL;
    PyObject *result = NULL;
    if (ar.len % 8 || (uintptr_t)ar.buf & 7) {
        PyErr_SetString(PyExc_ValueError, "arr must be an aligned array of 8-byte values");
        goto done;
    }
    size_t n = (size_t)ar.len / 8;
    if (n > 1) {
        uint64_t *scratch = PyMem_RawMalloc(ar.len);
        size_t(*counts)[RADIX] = PyMem_RawMalloc(sizeof(size_t) * RADIX_PASSES * RADIX);
        if (scratch == NULL || counts == NULL) {
            PyMem_RawFree(scratch);
            PyMem_RawFree(counts);
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        radix_sort(ar.buf, scratch, n, counts);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(scratch);
        PyMem_RawFree(counts);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ar);
    return result;
}

/* One heap entry: a part's next entry and the part's index. */
typedef struct {
    uint64_t head;
    Py_ssize_t part;
} merge_head;

static void
sift_down(merge_head *heap, Py_ssize_t n, Py_ssize_t i)
{
    merge_head x = heap[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && heap[c + 1].head < heap[c].head)
            c++;
        if (heap[c].head >= x.head)
            break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = x;
}

/* Merge k sorted arrays (data[i], len[i]) into out; see merge's comment. */
static size_t
merge_sorted(const uint64_t **data, const size_t *len, size_t *at, merge_head *heap,
             Py_ssize_t k, const unsigned char *live, uint64_t *out)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        if (len[i]) {
            heap[n].head = data[i][0];
            heap[n].part = i;
            at[i] = 0;
            n++;
        }
    for (Py_ssize_t i = n / 2 - 1; i >= 0; i--)
        sift_down(heap, n, i);
    size_t written = 0;
    uint64_t last = 0;
    int any = 0;
    while (n) {
        Py_ssize_t p = heap[0].part;
        /* The smallest head among the other parts: a child of the root. */
        uint64_t bound = UINT64_MAX;
        if (n > 1)
            bound = heap[1].head;
        if (n > 2 && heap[2].head < bound)
            bound = heap[2].head;
        const uint64_t *d = data[p];
        size_t i = at[p], end = len[p];
        do {
            uint64_t v = d[i];
            if (live[v & LOW_MASK] && (!any || v != last)) {
                out[written++] = v;
                last = v;
                any = 1;
            }
            i++;
        } while (i < end && d[i] <= bound);
        at[p] = i;
        if (i < end) {
            heap[0].head = d[i];
        } else {
            heap[0] = heap[--n];
        }
        if (n)
            sift_down(heap, n, 0);
    }
    return written;
}

static PyObject *
merge(PyObject *self, PyObject *args)
{
    PyObject *seq_in;
    Py_buffer lv, ou;
    if (!PyArg_ParseTuple(args, "Oy*w*", &seq_in, &lv, &ou))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    Py_buffer *views = NULL;
    const uint64_t **data = NULL;
    size_t *len = NULL, *at = NULL;
    merge_head *heap = NULL;
    Py_ssize_t k = 0, got = 0;
    if (lv.len != SLOTS || ou.len % 8 || ((uintptr_t)ou.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "live must be %d bytes, out an aligned uint64 array",
                     SLOTS);
        goto done;
    }
    seq = PySequence_Fast(seq_in, "parts must be a sequence of uint64 arrays");
    if (seq == NULL)
        goto done;
    k = PySequence_Fast_GET_SIZE(seq);
    views = PyMem_Calloc((size_t)k + 1, sizeof(Py_buffer));
    data = PyMem_Calloc((size_t)k + 1, sizeof(*data));
    len = PyMem_Calloc((size_t)k + 1, sizeof(*len));
    at = PyMem_Calloc((size_t)k + 1, sizeof(*at));
    heap = PyMem_Calloc((size_t)k + 1, sizeof(*heap));
    if (!views || !data || !len || !at || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    size_t total = 0;
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (views[got].len % 8 || ((uintptr_t)views[got].buf & 7)) {
            got++;
            PyErr_SetString(PyExc_ValueError, "parts must be aligned uint64 arrays");
            goto done;
        }
        data[got] = views[got].buf;
        len[got] = (size_t)views[got].len / 8;
        total += len[got];
    }
    if ((size_t)ou.len / 8 < total) {
        PyErr_Format(PyExc_ValueError, "out holds %zd entries, the parts %zu",
                     ou.len / 8, total);
        goto done;
    }
    size_t written;
    Py_BEGIN_ALLOW_THREADS
    written = merge_sorted(data, len, at, heap, k, lv.buf, ou.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSize_t(written);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(data);
    PyMem_Free(len);
    PyMem_Free(at);
    PyMem_Free(heap);
    Py_XDECREF(seq);
    PyBuffer_Release(&ou);
    PyBuffer_Release(&lv);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(keys, out) -> bool: each 32-byte key's fingerprint into out (8 bytes each); "
     "whether all keys share the first key's namespace."},
    {"namespaces", namespaces, METH_VARARGS,
     "namespaces(keys, index, cap) -> list | None: the distinct namespace digests of keys, "
     "each key's position among them into index; None past cap distinct ones."},
    {"match_slots", match_slots, METH_VARARGS,
     "match_slots(arr, starts, shift, want, seen, out, count) -> int: the slots of arr's "
     "entries matching any wanted value, appended to out (see the module's comment)."},
    {"probe", probe, METH_VARARGS,
     "probe(slots, shift, fps, out): each fingerprint's tier in a key table, -1 if absent."},
    {"place", place, METH_VARARGS,
     "place(entries, slots, shift, by_tier) -> (live, last): sorted entries placed into an "
     "empty key table; by_tier counted; last: the last slot needed (-1: none)."},
    {"sort", sort, METH_VARARGS,
     "sort(arr): a uint64 array sorted in place (a radix sort, without the GIL)."},
    {"merge", merge, METH_VARARGS,
     "merge(parts, live, out) -> int: sorted parts merged into out, entries of slots not "
     "live and repeats left out; how many were written."},
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
