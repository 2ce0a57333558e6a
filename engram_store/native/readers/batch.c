/* The read calls' arguments, their checks and the step run as each extent completes (batch.h). */
#include "batch.h"

#include <string.h>

#include "crc32c.h"  /* crc32c_check_pages; PAGE, MAX_CHECKED_PAGES */

/* Takes obj's buffer into a->views (released by batch_release, even on failure). */
int batch_view(batch_args_t *a, PyObject *obj, int writable, int int64, const char *name) {
    Py_buffer *v = &a->views[a->nviews];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    a->nviews++;
    if (int64 && (v->itemsize != 8 || v->len % 8)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 buffer", name);
        return -1;
    }
    return 0;
}

void batch_release(batch_args_t *a) {
    for (int k = 0; k < a->nviews; k++) PyBuffer_Release(&a->views[k]);
    a->nviews = 0;
}

/* file_offsets and lengths, views 1 and 2 of either call. */
static void batch_set_extents(batch_args_t *a) {
    a->n = a->views[1].len / 8; a->off = a->views[1].buf;
    a->n_len = a->views[2].len / 8; a->len = a->views[2].buf;
}

int batch_views_batch(batch_args_t *a, PyObject *buf, PyObject *off, PyObject *len, PyObject *dst) {
    if (batch_view(a, buf, 1, 0, "buf") < 0 || batch_view(a, off, 0, 1, "file_offsets") < 0 ||
        batch_view(a, len, 0, 1, "lengths") < 0 || batch_view(a, dst, 0, 1, "buf_offsets") < 0)
        return -1;
    batch_set_extents(a);
    a->buf = a->views[0].buf; a->buf_len = a->views[0].len;
    a->n_dst = a->views[3].len / 8; a->dst = a->views[3].buf;
    return 0;
}

int batch_views_rows(batch_args_t *a, PyObject *out, long long row_bytes, PyObject *off, PyObject *len,
                               PyObject *first_row, PyObject *row_off) {
    if (batch_view(a, out, 1, 0, "out") < 0 || batch_view(a, off, 0, 1, "file_offsets") < 0 ||
        batch_view(a, len, 0, 1, "lengths") < 0 || batch_view(a, first_row, 0, 1, "first_row") < 0 ||
        batch_view(a, row_off, 0, 1, "row_offsets") < 0)
        return -1;
    batch_set_extents(a);
    a->out = a->views[0].buf; a->out_len = a->views[0].len;
    a->row_bytes = row_bytes;
    a->n_first = a->views[3].len / 8; a->first_row = a->views[3].buf;
    a->rows = a->views[4].len / 8; a->row_off = a->views[4].buf;
    return 0;
}

int batch_check_extents(batch_args_t *a, int64_t max_len) {
    if (a->n_len != a->n) {
        PyErr_SetString(PyExc_ValueError, "file_offsets and lengths must have one length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (a->off[i] < 0 || a->len[i] <= 0 || (max_len && a->len[i] > max_len)) {
            if (max_len)
                PyErr_Format(PyExc_ValueError, "extent %zd: offset %lld, length %lld (lengths must be within 1..%lld)",
                             i, (long long)a->off[i], (long long)a->len[i], (long long)max_len);
            else
                PyErr_Format(PyExc_ValueError, "extent %zd: offset %lld, length %lld", i, (long long)a->off[i],
                             (long long)a->len[i]);
            return -1;
        }
    }
    return 0;
}

int64_t batch_longest(const batch_args_t *a) {
    int64_t longest = 0;
    for (Py_ssize_t i = 0; i < a->n; i++) longest = a->len[i] > longest ? a->len[i] : longest;
    return longest;
}

int batch_check_dst(batch_args_t *a) {
    if (a->n_dst != a->n) {
        PyErr_SetString(PyExc_ValueError, "buf_offsets must match file_offsets");
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (a->dst[i] < 0 || a->dst[i] + a->len[i] > a->buf_len) {
            PyErr_Format(PyExc_ValueError, "read %zd (%lld bytes to %lld) is outside the %zd-byte buffer", i,
                         (long long)a->len[i], (long long)a->dst[i], a->buf_len);
            return -1;
        }
    }
    return 0;
}

/* scratch_len < 0: the caller's scratch is not an argument (the ring owns its slots). */
int batch_check_rows(batch_args_t *a, int64_t scratch_need, Py_ssize_t scratch_len) {
    int with_scratch = scratch_len >= 0;
    if (a->row_bytes <= 0 || a->n_first != a->n + 1 || a->rows * a->row_bytes > a->out_len ||
        (with_scratch && scratch_need > scratch_len)) {
        PyErr_SetString(PyExc_ValueError, with_scratch ? "read_rows: first_row needs n+1 entries, out rows * row_bytes "
                                                         "bytes, scratch queue_depth * max(lengths) bytes"
                                                       : "read_rows: first_row needs n+1 entries, out rows * row_bytes bytes");
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (a->first_row[i] < 0 || a->first_row[i] > a->first_row[i + 1] || a->first_row[i + 1] > a->rows) {
            PyErr_Format(PyExc_ValueError, "read_rows: first_row must be non-decreasing within [0, %zd]", a->rows);
            return -1;
        }
        for (int64_t r = a->first_row[i]; r < a->first_row[i + 1]; r++) {
            if (a->row_off[r] < 0 || a->row_off[r] + a->row_bytes > a->len[i]) {
                PyErr_Format(PyExc_ValueError, "read_rows: row %lld at %lld is outside extent %zd", (long long)r,
                             (long long)a->row_off[r], i);
                return -1;
            }
        }
    }
    return 0;
}

/* page_crcs=None: no page checks (bad is then ignored). */
int batch_check_pages(batch_args_t *a, PyObject *o_crcs, PyObject *o_bad) {
    if (o_crcs == Py_None) return 0;
    int first = a->nviews;
    if ((o_bad == Py_None) || batch_view(a, o_crcs, 0, 0, "page_crcs") < 0 || batch_view(a, o_bad, 1, 1, "bad") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read_rows: page_crcs needs a bad buffer too");
        return -1;
    }
    const Py_buffer *crcs = &a->views[first], *bad = &a->views[first + 1];
    if (crcs->itemsize != 4 || crcs->len % 4) {
        PyErr_SetString(PyExc_TypeError, "page_crcs must be a uint32 buffer");
        return -1;
    }
    a->crcs = crcs->buf; a->ncrcs = crcs->len / 4; a->bad = bad->buf;
    int64_t pages = 0;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (a->off[i] % PAGE || a->len[i] % PAGE || a->len[i] > MAX_CHECKED_PAGES * PAGE ||
            (a->off[i] + a->len[i]) / PAGE > a->ncrcs) {
            PyErr_Format(PyExc_ValueError, "read_rows: checked extent %zd (%lld bytes at %lld) must be whole pages, "
                         "at most %d, inside the %lld pages page_crcs covers", i, (long long)a->len[i],
                         (long long)a->off[i], MAX_CHECKED_PAGES, (long long)a->ncrcs);
            return -1;
        }
        pages += a->len[i] / PAGE;
    }
    if (bad->len / 8 < pages) {
        PyErr_Format(PyExc_ValueError, "read_rows: bad holds %zd entries, %lld pages are read", bad->len / 8,
                     (long long)pages);
        return -1;
    }
    return 0;
}

/* Where extent i is read to: its slot (read_rows) or its place in buf (read_batch). */
char *batch_target(const batch_args_t *a, Py_ssize_t i, int slot) {
    return a->scratch ? a->scratch + (int64_t)slot * a->slot : a->buf + a->dst[i];
}

/* Extent i has arrived in its slot: check its pages (when crcs are given), then copy out the
   rows of the pages that passed. Nothing to do for read_batch (no scratch). */
void batch_complete(batch_args_t *a, Py_ssize_t i, int slot) {
    if (!a->scratch) return;
    const char *src = a->scratch + (int64_t)slot * a->slot;
    uint64_t bad_mask = 0;
    if (a->crcs && a->crc_stride > 1) {  /* a stripe: its pages are not consecutive in crcs */
        for (int64_t k = 0; k < a->len[i] / PAGE; k++)
            bad_mask |= crc32c_check_pages((const uint8_t *)src + k * PAGE,
                                           (a->off[i] / PAGE + k) * a->crc_stride + a->crc_phase, 1, a->crcs,
                                           a->bad, &a->nbad) << k;
    } else if (a->crcs) {
        bad_mask = crc32c_check_pages((const uint8_t *)src, a->off[i] / PAGE, a->len[i] / PAGE, a->crcs, a->bad, &a->nbad);
    }
    for (int64_t r = a->first_row[i]; r < a->first_row[i + 1]; r++)
        if (!bad_mask || !(bad_mask >> (a->row_off[r] / PAGE) & 1))
            memcpy(a->out + r * a->row_bytes, src + a->row_off[r], (size_t)a->row_bytes);
}
