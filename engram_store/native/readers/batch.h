/* The arguments of one read_batch / read_rows call and the step run as each extent completes;
 * one unit (batch.c) linked into _pread (Linux AIO), _uring (io_uring) and _fetch (the engines' direct reads).
 *
 * A caller fills a batch_args_t in this order (its own checks between), stopping at the first
 * that fails (each sets the Python exception: TypeError for a buffer of the wrong kind,
 * ValueError for bad values):
 *   batch_views_batch(a, buf, file_offsets, lengths, buf_offsets)      read_batch's buffers
 *   batch_views_rows(a, out, row_bytes, file_offsets, lengths, first_row, row_offsets)
 *                                                                      read_rows' buffers
 *   batch_view(a, obj, writable, int64, name)                          one more (a module's own)
 *   batch_check_extents(a, max_len)     offsets >= 0, lengths within 1..max_len (0: no bound)
 *   batch_check_dst(a)                  read_batch: each extent inside buf
 *   batch_check_rows(a, need, have)     read_rows: first_row, out and each row inside its extent;
 *                                       with have >= 0 also scratch (need bytes of have)
 *   batch_check_pages(a, page_crcs, bad) read_rows: page_crcs=/bad= (None: no page checks)
 * then sets a->scratch and a->slot (read_rows: where extent reads land), runs the reads with
 * the GIL released, calling batch_complete(a, i, slot) as extent i arrives in its slot (no
 * Python API), and finally batch_release(a), on every path (it releases the views taken).
 */
#ifndef ENGRAM_STORE_BATCH_H
#define ENGRAM_STORE_BATCH_H

#include <Python.h>
#include <stdint.h>

#define MAX_VIEWS 8

typedef struct {
    Py_ssize_t n, n_len;                  /* extents: entries in file_offsets, in lengths */
    const int64_t *off, *len;             /* extent i: len[i] bytes at file offset off[i] */
    char *buf; const int64_t *dst;        /* read_batch: extent i goes to buf + dst[i] */
    Py_ssize_t buf_len, n_dst;
    char *out; int64_t row_bytes;         /* read_rows: row r goes to out + r * row_bytes ... */
    const int64_t *first_row, *row_off;   /* ... from row_off[r] in extent i, first_row[i] <= r < first_row[i+1] */
    Py_ssize_t rows, out_len, n_first;
    char *scratch; int64_t slot;          /* read_rows: slot k is slot bytes at scratch + k * slot */
    const uint32_t *crcs; int64_t ncrcs;  /* read_rows: expected crc32c per page of the file, or NULL */
    int64_t crc_stride, crc_phase;        /* file page p is page p * crc_stride + crc_phase of crcs (a stripe k
                                             of K: K, k; extents of one page); crc_stride 0 or 1: page p */
    int64_t *bad; int64_t nbad;           /* read_rows: page numbers that failed their check */
    Py_buffer views[MAX_VIEWS]; int nviews;
} batch_args_t;

/* Takes obj's buffer into a->views (released by batch_release, even on failure). */
int batch_view(batch_args_t *a, PyObject *obj, int writable, int int64, const char *name);
/* Releases the views taken (on every path). */
void batch_release(batch_args_t *a);
int batch_views_batch(batch_args_t *a, PyObject *buf, PyObject *off, PyObject *len, PyObject *dst);
int batch_views_rows(batch_args_t *a, PyObject *out, long long row_bytes, PyObject *off, PyObject *len,
                     PyObject *first_row, PyObject *row_off);
/* The longest extent (bytes). */
int64_t batch_longest(const batch_args_t *a);
int batch_check_extents(batch_args_t *a, int64_t max_len);
int batch_check_dst(batch_args_t *a);
/* scratch_len < 0: the caller's scratch is not an argument (the ring owns its slots). */
int batch_check_rows(batch_args_t *a, int64_t scratch_need, Py_ssize_t scratch_len);
/* page_crcs=None: no page checks (bad is then ignored). */
int batch_check_pages(batch_args_t *a, PyObject *o_crcs, PyObject *o_bad);
/* Where extent i is read to: its slot (read_rows) or its place in buf (read_batch). */
char *batch_target(const batch_args_t *a, Py_ssize_t i, int slot);
/* Extent i has arrived in its slot: check its pages (when crcs are given), then copy out the
   rows of the pages that passed. Nothing to do for read_batch (no scratch). */
void batch_complete(batch_args_t *a, Py_ssize_t i, int slot);

#endif
