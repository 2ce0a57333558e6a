/* engram_store.native._gather: row gathers from a DRAM arena on a small pool of native threads, the row
 * cache's bookkeeping, and the staging gate for the daemon's Python path. The copying is pool.c's; this
 * file is the module: its Python calls and its C API (gather_api.h).
 *
 * gather(src, row_bytes, index, out, threads=1) -> None
 *     out[i] = src[index[i]] for rows of row_bytes bytes.
 * gather_split(weights, weight_bytes, scales, scale_bytes, index, out, threads=1) -> None
 *     The same for a table kept in two blocks, the engines' layout (every row's payload in one block,
 *     every row's scales in the other): out[i] is weights[index[i]] followed by scales[index[i]],
 *     weight_bytes + scale_bytes bytes, i.e. the row as it is stored on disk.
 * gather_to_split(src, weight_bytes, scale_bytes, index, positions, weights_out, scales_out, threads=1)
 * gather_split_to_split(weights, weight_bytes, scales, scale_bytes, index, positions, weights_out,
 *                       scales_out, threads=1)
 *     Rows into a client's staging in the engines' split layout, row i at positions[i] (one host copy:
 *     engram_store/wire/staging.py), from packed rows or from a split table.
 *     The four are one call (gather_layout) over the layout of gather_job_t: one parse, one set of
 *     checks, one release. An index outside [0, rows) raises IndexError before anything is copied;
 *     up to `threads` threads copy (pool.c).
 * take_int32(table, index, out) -> None, bump_uint8(counts, index, cap) -> None
 *     The row cache's per-lookup bookkeeping: row-to-slot entries read at random rows (prefetched), hit
 *     counts raised up to a cap (numpy's semantics for repeated indices). On the caller's thread, the GIL
 *     released.
 * EpochGuard()
 *     The row cache's lock and reader epochs, shared with the daemon's native path (epoch_guard.h).
 * gate_claim(buffer, offset, request_id), gate_done(buffer, offset, request_id)
 *     The staging's gate (common/staging_gate.h) for the daemon's Python path (native/gather/split_out.py).
 * prime(), pool_size()
 *     Wake idle workers ahead of a gather; the workers started in this process.
 */
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gather_api.h"   /* engram_gather_api, gather_job_t */
#include "pool.h"         /* gather_run, gather_prime: the copying */
#include "epoch_guard.h"  /* EpochGuard: the row cache's lock and reader epochs */
#include "staging_gate.h" /* gate_claim, gate_done: a client staging's gate (the daemon's Python path) */

#define PREFETCH_AHEAD 12

/* The four Python gathers: source packed or split, destination packed or split (at positions); the
   messages each gives for its own arguments. */
typedef struct {
    const char *name;
    int split_src, split_out;
    const char *bad_sizes, *short_out; /* packed destinations: row sizes, out too small */
} layout_t;

static const layout_t GATHER = {"gather", 0, 0, "gather: row_bytes must be positive",
                                "gather: out needs len(index) * row_bytes bytes"};
static const layout_t GATHER_SPLIT = {"gather_split", 1, 0,
                                      "gather_split: weight_bytes must be positive, scale_bytes >= 0",
                                      "gather_split: out needs len(index) * (weight_bytes + scale_bytes) bytes"};
static const layout_t GATHER_TO_SPLIT = {"gather_to_split", 0, 1, NULL, NULL};
static const layout_t GATHER_SPLIT_TO_SPLIT = {"gather_split_to_split", 1, 1, NULL, NULL};

static int take_view(PyObject *o, int flags, Py_buffer *v, int *nv) {
    if (PyObject_GetBuffer(o, &v[*nv], PyBUF_C_CONTIGUOUS | flags) < 0) return -1;
    (*nv)++;
    return 0;
}

/* A packed destination: index (int64) and out (writable). */
static int get_index_and_out(PyObject *o_idx, PyObject *o_out, Py_buffer *v, int *nv) {
    if (take_view(o_idx, PyBUF_FORMAT, v, nv) < 0) return -1;
    if (v[*nv - 1].itemsize != 8 || v[*nv - 1].len % 8) {
        PyErr_SetString(PyExc_TypeError, "gather: index must be an int64 buffer");
        return -1;
    }
    return take_view(o_out, PyBUF_WRITABLE, v, nv);
}

/* A split destination: index, positions (int64, as many), the two output blocks (writable). 0, or -1 with
   an exception: every position must be a row of both blocks. */
static int get_split_outs(PyObject *o_idx, PyObject *o_pos, PyObject *o_wout, PyObject *o_sout, long long wb,
                          long long sb, Py_buffer *v, int *nv) {
    PyObject *objs[4] = {o_idx, o_pos, o_wout, o_sout};
    for (int k = 0; k < 4; k++)
        if (take_view(objs[k], k >= 2 ? PyBUF_WRITABLE : 0, v, nv) < 0) return -1;
    const Py_buffer *idx = &v[*nv - 4], *pos = &v[*nv - 3], *wout = &v[*nv - 2], *sout = &v[*nv - 1];
    if (idx->len % 8 || pos->len != idx->len) {
        PyErr_SetString(PyExc_TypeError, "gather to split: index and positions must be int64 buffers of one length");
        return -1;
    }
    if (wb <= 0 || sb < 0) {
        PyErr_SetString(PyExc_ValueError, "gather to split: weight_bytes must be positive, scale_bytes >= 0");
        return -1;
    }
    /* rows without block scales (FP8 with one table scale, BF16): the scale block is empty */
    const int64_t out_rows = sb == 0 || wout->len / wb < sout->len / sb ? wout->len / wb : sout->len / sb;
    const int64_t *p = pos->buf, n = pos->len / 8;
    for (int64_t i = 0; i < n; i++) {
        if (p[i] < 0 || p[i] >= out_rows) {
            PyErr_Format(PyExc_IndexError, "gather to split: position %lld (at %lld) is outside the %lld output rows",
                         (long long)p[i], (long long)i, (long long)out_rows);
            return -1;
        }
    }
    return 0;
}

/* One gather call of layout L: its arguments parsed, its buffers taken and checked, the rows copied
   without the GIL, the buffers released. */
static PyObject *gather_layout(PyObject *args, const layout_t *L) {
    PyObject *o_src, *o_src2 = NULL, *o_idx, *o_out = NULL, *o_pos = NULL, *o_wout = NULL, *o_sout = NULL;
    long long wb, sb = 0;
    int threads = 1, parsed;
    if (!L->split_src && !L->split_out)
        parsed = PyArg_ParseTuple(args, "OLOO|i", &o_src, &wb, &o_idx, &o_out, &threads);
    else if (!L->split_out)
        parsed = PyArg_ParseTuple(args, "OLOLOO|i", &o_src, &wb, &o_src2, &sb, &o_idx, &o_out, &threads);
    else if (!L->split_src)
        parsed = PyArg_ParseTuple(args, "OLLOOOO|i", &o_src, &wb, &sb, &o_idx, &o_pos, &o_wout, &o_sout, &threads);
    else
        parsed = PyArg_ParseTuple(args, "OLOLOOOO|i", &o_src, &wb, &o_src2, &sb, &o_idx, &o_pos, &o_wout, &o_sout,
                                  &threads);
    if (!parsed) return NULL;
    Py_buffer v[6];
    int nv = 0;
    PyObject *result = NULL;
    if (take_view(o_src, 0, v, &nv) < 0 || (L->split_src && take_view(o_src2, 0, v, &nv) < 0)) goto done;
    const int first_idx = nv; /* then index, and out or (positions, weights_out, scales_out) */
    if (L->split_out ? get_split_outs(o_idx, o_pos, o_wout, o_sout, wb, sb, v, &nv)
                     : get_index_and_out(o_idx, o_out, v, &nv))
        goto done;
    if (!L->split_out && (wb <= 0 || sb < 0)) {
        PyErr_SetString(PyExc_ValueError, L->bad_sizes);
        goto done;
    }
    const int64_t n = v[first_idx].len / 8, rows = v[0].len / (L->split_src ? wb : wb + sb);
    if (L->split_src && rows * sb > v[1].len) {
        PyErr_Format(PyExc_ValueError, "%s: scales hold fewer rows than weights", L->name);
        goto done;
    }
    if (!L->split_out && n * (wb + sb) > v[first_idx + 1].len) {
        PyErr_SetString(PyExc_ValueError, L->short_out);
        goto done;
    }
    const int64_t *idx = v[first_idx].buf;
    gather_job_t job = {.src = v[0].buf, .src2 = L->split_src && sb ? v[1].buf : NULL, .idx = idx, .n = n,
                        .rows = rows, .row_bytes = (size_t)wb, .row_bytes2 = (size_t)sb};
    if (L->split_out) {
        job.pos = v[first_idx + 1].buf;
        job.wout = v[first_idx + 2].buf;
        job.sout = v[first_idx + 3].buf;
    } else {
        job.out = v[first_idx + 1].buf;
    }
    int64_t first_bad;
    Py_BEGIN_ALLOW_THREADS
    first_bad = gather_run(&job, threads);
    Py_END_ALLOW_THREADS
    if (first_bad >= 0) {
        PyErr_Format(PyExc_IndexError, "gather: index %lld at position %lld is outside [0, %lld)",
                     (long long)idx[first_bad], (long long)first_bad, (long long)rows);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < nv; i++) PyBuffer_Release(&v[i]);
    return result;
}

static PyObject *gather(PyObject *Py_UNUSED(self), PyObject *args) { return gather_layout(args, &GATHER); }
static PyObject *gather_split(PyObject *Py_UNUSED(self), PyObject *args) { return gather_layout(args, &GATHER_SPLIT); }
static PyObject *gather_to_split(PyObject *Py_UNUSED(self), PyObject *args) {
    return gather_layout(args, &GATHER_TO_SPLIT);
}
static PyObject *gather_split_to_split(PyObject *Py_UNUSED(self), PyObject *args) {
    return gather_layout(args, &GATHER_SPLIT_TO_SPLIT);
}

static PyObject *prime(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    gather_prime();
    Py_RETURN_NONE;
}

static PyObject *pool_size(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLong(gather_pool_size());
}

/* out[i] = table[index[i]] (int32), prefetching PREFETCH_AHEAD entries ahead: the cache's row-to-slot
   lookups, a random read per row over a table of the layer's size. Returns the first bad i, or -1. */
static int64_t take_i32(const int32_t *table, int64_t len, const int64_t *index, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            const int64_t ahead = index[i + PREFETCH_AHEAD];
            if (ahead >= 0 && ahead < len) __builtin_prefetch(table + ahead, 0, 0);
        }
        const int64_t k = index[i];
        if (k < 0 || k >= len) return i;
        out[i] = table[k];
    }
    return -1;
}

static PyObject *take_int32(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_table, *o_idx, *o_out;
    if (!PyArg_ParseTuple(args, "OOO", &o_table, &o_idx, &o_out)) return NULL;
    Py_buffer t, x, o;
    if (PyObject_GetBuffer(o_table, &t, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(o_idx, &x, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&t);
        return NULL;
    }
    if (PyObject_GetBuffer(o_out, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&t);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *result = NULL;
    if (t.itemsize != 4 || x.itemsize != 8 || o.itemsize != 4 || o.len / 4 < x.len / 8) {
        PyErr_SetString(PyExc_TypeError, "take_int32(table int32, index int64, out int32 of len(index))");
    } else {
        const int64_t n = x.len / 8, len = t.len / 4;
        int64_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = take_i32(t.buf, len, x.buf, n, o.buf);
        Py_END_ALLOW_THREADS
        if (bad >= 0)
            PyErr_Format(PyExc_IndexError, "take_int32: index %lld is outside [0, %lld)",
                         (long long)((int64_t *)x.buf)[bad], (long long)len);
        else
            result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&t);
    PyBuffer_Release(&x);
    PyBuffer_Release(&o);
    return result;
}

/* counts[index[i]] = min(counts[index[i]], cap - 1) + 1 for i < n, uint8 counts, index int64 (index_bytes 8) or
   int32 (4), with numpy's fancy-assignment semantics (every count read before any is written, so an index listed
   twice counts once): S3-FIFO's hit counts. `next` is n bytes of scratch. Returns -1 when every index is in
   [0, len), else the position i (>= 0) of the first index outside it (nothing written then): a position, never an
   index value, so that a bad index of -1 cannot read as success. */
static int64_t bump_counts(uint8_t *counts, int64_t len, const void *index, int index_bytes, int64_t n, int cap,
                           uint8_t *next) {
#define AT(i) (index_bytes == 8 ? ((const int64_t *)index)[i] : (int64_t)((const int32_t *)index)[i])
    for (int64_t i = 0; i < n; i++) {
        const int64_t k = AT(i);
        if (k < 0 || k >= len) return i;
        next[i] = (uint8_t)((counts[k] < cap - 1 ? counts[k] : cap - 1) + 1);
    }
    for (int64_t i = 0; i < n; i++) counts[AT(i)] = next[i];
    return -1;
#undef AT
}

static PyObject *bump_uint8(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_counts, *o_idx;
    int cap;
    if (!PyArg_ParseTuple(args, "OOi", &o_counts, &o_idx, &cap)) return NULL;
    Py_buffer c, x;
    if (PyObject_GetBuffer(o_counts, &c, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(o_idx, &x, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&c);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t n = x.itemsize ? x.len / x.itemsize : 0;
    uint8_t *next = n ? malloc((size_t)n) : NULL;
    if (c.itemsize != 1 || (x.itemsize != 4 && x.itemsize != 8) || cap < 1 || cap > 255) {
        PyErr_SetString(PyExc_TypeError, "bump_uint8(counts uint8, index int32 or int64, cap in 1..255)");
    } else if (n && next == NULL) {
        PyErr_NoMemory();
    } else {
        int64_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = bump_counts(c.buf, c.len, x.buf, (int)x.itemsize, n, cap, next);
        Py_END_ALLOW_THREADS
        if (bad >= 0) {
            const long long value = x.itemsize == 8 ? (long long)((const int64_t *)x.buf)[bad]
                                                    : (long long)((const int32_t *)x.buf)[bad];
            PyErr_Format(PyExc_IndexError, "bump_uint8: index %lld (position %lld) is outside [0, %lld)", value,
                         (long long)bad, (long long)c.len);
        }
        else
            result = Py_NewRef(Py_None);
    }
    free(next);
    PyBuffer_Release(&c);
    PyBuffer_Release(&x);
    return result;
}

/* The staging gate's word at `offset` of a writable buffer (staging_gate.h), for the daemon's Python path. */
static uint32_t *gate_at(PyObject *args, Py_buffer *b, unsigned long long *rid) {
    PyObject *o;
    long long offset;
    if (!PyArg_ParseTuple(args, "OLK", &o, &offset, rid)) return NULL;
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (offset < 0 || offset + 4 > b->len || ((uintptr_t)b->buf + (uintptr_t)offset) % 4) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "gate: a 4-byte aligned word inside the buffer");
        return NULL;
    }
    return (uint32_t *)((char *)b->buf + offset);
}

static PyObject *py_gate_claim(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b;
    unsigned long long rid;
    uint32_t *g = gate_at(args, &b, &rid);
    if (g == NULL) return NULL;
    const int claimed = gate_claim(g, rid);
    PyBuffer_Release(&b);
    return PyBool_FromLong(claimed);
}

static PyObject *py_gate_done(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer b;
    unsigned long long rid;
    uint32_t *g = gate_at(args, &b, &rid);
    if (g == NULL) return NULL;
    gate_done(g, rid);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static engram_gather_api c_api = {.run = gather_run, .prime = gather_prime, .take_int32 = take_i32,
                                  .bump_counts = bump_counts, .guard_type = &EpochGuardType,
                                  .guard_lock = guard_lock, .guard_unlock = guard_unlock, .guard_enter = guard_enter,
                                  .guard_leave = guard_leave};

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "gather(src, row_bytes, index, out, threads=1) -> None"},
    {"take_int32", take_int32, METH_VARARGS,
     "take_int32(table, index, out) -> None: out[i] = table[index[i]], int32 entries, prefetched"},
    {"bump_uint8", bump_uint8, METH_VARARGS,
     "bump_uint8(counts, index, cap) -> None: counts[index] = min(counts[index], cap - 1) + 1 (uint8, as numpy)"},
    {"gather_split", gather_split, METH_VARARGS,
     "gather_split(weights, weight_bytes, scales, scale_bytes, index, out, threads=1) -> None"},
    {"gather_to_split", gather_to_split, METH_VARARGS,
     "gather_to_split(src, weight_bytes, scale_bytes, index, positions, weights_out, scales_out, threads=1) -> None: "
     "packed row index[i] into row positions[i] of the two output blocks"},
    {"gather_split_to_split", gather_split_to_split, METH_VARARGS,
     "gather_split_to_split(weights, weight_bytes, scales, scale_bytes, index, positions, weights_out, scales_out, "
     "threads=1) -> None"},
    {"gate_claim", py_gate_claim, METH_VARARGS,
     "gate_claim(buffer, offset, request_id) -> bool: a staging gate OPEN(request) -> WRITING (common/staging_gate.h)"},
    {"gate_done", py_gate_done, METH_VARARGS,
     "gate_done(buffer, offset, request_id) -> None: WRITING(request) -> DONE, waking the client"},
    {"prime", prime, METH_NOARGS, "prime() -> None: wake idle workers, a gather is coming"},
    {"pool_size", pool_size, METH_NOARGS, "pool_size() -> worker threads started in this process"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather", "Row gathers split across a native thread pool.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gather(void) {
    gather_pool_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyType_Ready(&EpochGuardType) < 0 || PyModule_AddObjectRef(m, "EpochGuard", (PyObject *)&EpochGuardType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&c_api, ENGRAM_GATHER_CAPSULE, NULL);
    if (api == NULL || PyModule_AddIntConstant(m, "MIN_SPLIT_ROWS", MIN_SPLIT_ROWS) < 0 ||
        PyModule_AddObject(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
