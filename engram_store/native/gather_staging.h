/* native/_gather.c's functions for a client's staging (one host copy, engram_store/wire/staging.py):
 * rows gathered into the engines' split layout at given positions, and the staging's gate
 * (staging_gate.h), for the daemon's Python path (engram_store/native/split_out.py). Included by
 * _gather.c after its row functions and bad_index.
 */
#ifndef ENGRAM_STORE_GATHER_STAGING_H
#define ENGRAM_STORE_GATHER_STAGING_H

/* Split outputs of gather_to_split / gather_split_to_split: index, positions (int64, as many), the two
   output blocks (writable). 0, or -1 with an exception: every position must be a row of both blocks. */
static int get_split_outs(PyObject *o_idx, PyObject *o_pos, PyObject *o_wout, PyObject *o_sout, long long wb,
                          long long sb, Py_buffer *v, int *nv) {
    PyObject *objs[4] = {o_idx, o_pos, o_wout, o_sout};
    for (int k = 0; k < 4; k++) {
        if (PyObject_GetBuffer(objs[k], &v[*nv], PyBUF_C_CONTIGUOUS | (k >= 2 ? PyBUF_WRITABLE : 0)) < 0) return -1;
        (*nv)++;
    }
    const Py_buffer *idx = &v[*nv - 4], *pos = &v[*nv - 3], *wout = &v[*nv - 2], *sout = &v[*nv - 1];
    if (idx->len % 8 || pos->len != idx->len) {
        PyErr_SetString(PyExc_TypeError, "gather to split: index and positions must be int64 buffers of one length");
        return -1;
    }
    if (wb <= 0 || sb <= 0) {
        PyErr_SetString(PyExc_ValueError, "gather to split: weight_bytes and scale_bytes must be positive");
        return -1;
    }
    const int64_t out_rows = wout->len / wb < sout->len / sb ? wout->len / wb : sout->len / sb;
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

/* gather_to_split(src, weight_bytes, scale_bytes, index, positions, weights_out, scales_out, threads=1) */
static PyObject *gather_to_split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_src, *o_idx, *o_pos, *o_wout, *o_sout;
    long long wb, sb;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OLLOOOO|i", &o_src, &wb, &sb, &o_idx, &o_pos, &o_wout, &o_sout, &threads))
        return NULL;
    Py_buffer v[5];
    int nv = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_src, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (get_split_outs(o_idx, o_pos, o_wout, o_sout, wb, sb, v, &nv) < 0) goto done;
    const int64_t n = v[1].len / 8, rows = v[0].len / (wb + sb);
    const int64_t *idx = v[1].buf;
    int64_t first_bad;
    Py_BEGIN_ALLOW_THREADS
    first_bad = gather_to_split_rows(v[0].buf, rows, (size_t)wb, (size_t)sb, idx, n, v[3].buf, v[4].buf, v[2].buf,
                                     threads);
    Py_END_ALLOW_THREADS
    if (first_bad >= 0 && bad_index(idx, first_bad, rows) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < nv; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* gather_split_to_split(weights, weight_bytes, scales, scale_bytes, index, positions, weights_out, scales_out,
   threads=1) */
static PyObject *gather_split_to_split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_w, *o_s, *o_idx, *o_pos, *o_wout, *o_sout;
    long long wb, sb;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OLOLOOOO|i", &o_w, &wb, &o_s, &sb, &o_idx, &o_pos, &o_wout, &o_sout, &threads))
        return NULL;
    Py_buffer v[6];
    int nv = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_w, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (PyObject_GetBuffer(o_s, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (get_split_outs(o_idx, o_pos, o_wout, o_sout, wb, sb, v, &nv) < 0) goto done;
    const int64_t n = v[2].len / 8, rows = v[0].len / wb;
    if (rows * sb > v[1].len) {
        PyErr_SetString(PyExc_ValueError, "gather_split_to_split: scales hold fewer rows than weights");
        goto done;
    }
    const int64_t *idx = v[2].buf;
    int64_t first_bad;
    Py_BEGIN_ALLOW_THREADS
    first_bad = gather_split_to_split_rows(v[0].buf, v[1].buf, rows, (size_t)wb, (size_t)sb, idx, n, v[4].buf,
                                           v[5].buf, v[3].buf, threads);
    Py_END_ALLOW_THREADS
    if (first_bad >= 0 && bad_index(idx, first_bad, rows) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < nv; i++) PyBuffer_Release(&v[i]);
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

#endif
