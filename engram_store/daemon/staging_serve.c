/* The native path's Flag.SPLIT lookups (staging_serve.h). */
#include "staging_serve.h"

#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>

#include "cached_hits.h"
#include "gather_api.h"
#include "staging_gate.h"

static void reply_ok(Conn *c, const frame_t *f) {
    frame_t reply = {.magic = MAGIC, .version = VERSION, .op = OP_RESULT, .layer = f->layer,
                     .request_id = f->request_id, .count = f->count};
    if (send_all(c->fd, &reply, sizeof reply) < 0) shutdown(c->fd, SHUT_RDWR);
}

/* A Flag.SPLIT lookup (engram_store/wire/staging.py): the ids copied and compacted (PAD_ID positions
   left alone), every one checked, then the rows written into the client's staging at their positions
   under its gate. 1 if answered (*rows: the ids served, now ids[0..rows)), 0 to leave it to the caller
   (which answers misses, errors and a request the client gave up on). */
int serve_split(Conn *c, const frame_t *f, double *seconds, uint64_t *rows) {
    const int64_t t0 = now_ns();
    if (!c->has_staging) return 0;
    const layer_t *l = NULL;
    for (Py_ssize_t i = 0; i < c->nlayers; i++)
        if (c->layers[i].layer == f->layer) l = &c->layers[i];
    const cached_layer_t *cached = l == NULL ? cache_layer(&c->cache, f->layer) : NULL;
    const uint64_t n = f->count, size = (uint64_t)c->region.len, first = f->out_offset;
    if ((l == NULL && cached == NULL) || n == 0 || n > c->max_rows || n > (uint64_t)c->ids.len / 8) return 0;
    if (f->ids_offset % 8 || f->ids_offset > size || n * 8 > size - f->ids_offset) return 0;
    if (first > (uint64_t)c->st_rows || n > (uint64_t)c->st_rows - first) return 0;
    int64_t *ids = c->ids.buf;
    memcpy(ids, (char *)c->region.buf + f->ids_offset, n * 8);
    int64_t m = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (ids[i] == SPLIT_PAD_ID) continue;
        ids[m] = ids[i];
        c->pos[m++] = (int64_t)(first + i);
    }
    uint32_t *gate = c->st_gate.buf;
    char *wout = c->st_weights.buf, *sout = c->st_scales.buf;
    const size_t wb = c->weight_bytes, sb = c->row_bytes - c->weight_bytes;
    if (m == 0) { /* all padding: nothing to write, the gate says so all the same */
        if (!gate_claim(gate, f->request_id)) return 0;
        gate_done(gate, f->request_id);
    } else if (cached != NULL) {
        if (m > FAIR_PIECE_ROWS) return 0;
        gather_api->prime();
        atomic_fetch_add(&small_active, 1);
        const int served = cache_serve_split(&c->cache, cached, ids, m, wout, sout, c->pos, wb, sb, gate,
                                             f->request_id, c->threads);
        small_done();
        if (!served) return 0;
    } else {
        const int64_t rows_in = l->weights.len / (Py_ssize_t)wb;
        for (int64_t i = 0; i < m; i++) /* every id first: on an error nothing is written */
            if ((uint64_t)ids[i] >= (uint64_t)rows_in) return 0;
        gather_api->prime();
        if (!gate_claim(gate, f->request_id)) return 0;
        for (int64_t at = 0; at < m; at += FAIR_PIECE_ROWS) {
            const int64_t len = m - at < FAIR_PIECE_ROWS ? m - at : FAIR_PIECE_ROWS;
            const int small = m <= FAIR_PIECE_ROWS;
            if (small) atomic_fetch_add(&small_active, 1);
            else yield_to_small();
            const gather_job_t job = {.src = l->weights.buf, .src2 = l->scales.buf, .rows = rows_in, .row_bytes = wb,
                                      .row_bytes2 = sb, .idx = ids + at, .n = len, .pos = c->pos + at, .wout = wout,
                                      .sout = sout};
            gather_api->run(&job, c->threads);
            if (small) small_done();
            else pieces_served++;
        }
        gate_done(gate, f->request_id);
    }
    reply_ok(c, f);
    *rows = (uint64_t)m;
    *seconds = (double)(now_ns() - t0) / 1e9;
    return 1;
}

/* set_staging(weights, scales, gate): the client's staging blocks (uint8 [rows, weight_bytes] and
   [rows, row_bytes - weight_bytes], writable, C-contiguous; the second empty for rows without block
   scales) and its gate word (4 writable bytes, aligned),
   as daemon/requests/staging.py checked and mapped them. */
PyObject *Conn_set_staging(Conn *c, PyObject *args) {
    PyObject *o_w, *o_s, *o_g;
    if (!c->open) {
        PyErr_SetString(PyExc_ValueError, "Conn is closed");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOO", &o_w, &o_s, &o_g)) return NULL;
    Py_buffer w, s, g;
    if (PyObject_GetBuffer(o_w, &w, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(o_s, &s, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    if (PyObject_GetBuffer(o_g, &g, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&s);
        return NULL;
    }
    const size_t wb = c->weight_bytes, sb = c->row_bytes - c->weight_bytes;
    const int64_t rows = (int64_t)((size_t)w.len / wb);
    int64_t *pos = PyMem_Malloc((size_t)(c->ids.len / 8 + 1) * sizeof(int64_t));
    if (rows < 1 || (size_t)s.len < (size_t)rows * sb || g.len < 4 || (uintptr_t)g.buf % 4 || pos == NULL) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&s);
        PyBuffer_Release(&g);
        PyMem_Free(pos);
        if (pos == NULL) return PyErr_NoMemory();
        PyErr_SetString(PyExc_ValueError, "set_staging: blocks of the row format (at least one row) and a 4-byte gate");
        return NULL;
    }
    release_staging(c);
    c->st_weights = w;
    c->st_scales = s;
    c->st_gate = g;
    c->st_rows = rows;
    c->pos = pos;
    c->has_staging = 1;
    Py_RETURN_NONE;
}
