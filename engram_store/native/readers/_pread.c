/* Batched positional reads with many in flight, the GIL released.
 *
 * read_batch(fd, buf, file_offsets, lengths, buf_offsets, queue_depth) -> bytes read
 *     Reads lengths[i] bytes at file_offsets[i] into buf[buf_offsets[i]:].
 *
 * read_rows(fd, out, row_bytes, file_offsets, lengths, first_row, row_offsets, scratch, queue_depth,
 *           page_crcs=None, bad=None) -> (bytes read, bad pages)
 *     Reads extent i (lengths[i] bytes at file_offsets[i]) into a slot of scratch
 *     and, as soon as it completes, copies rows first_row[i] .. first_row[i+1]-1
 *     into out (row r at out + r * row_bytes) from the slot at row_offsets[r].
 *     Slots are reused, so scratch needs only queue_depth * max(lengths) bytes:
 *     the pages of a request never need to sit in memory all at once.
 *     With page_crcs (uint32, the expected crc32c of every 4 KiB page of the
 *     file, indexed by page number), every page is checked as its read
 *     completes, before any row is copied out of it: the page number of each
 *     page that fails goes into bad (int64, one entry per page read at least)
 *     and its rows are not copied; the second item returned counts them.
 *     Extents must then be whole pages, at most 64 pages each.
 *
 * crc32c(data, value=0, software=False) -> int   crc32c (Castagnoli), chained like zlib.crc32
 * page_crcs(data, out, software=False)            out[i] = crc32c of 4 KiB page i of data (uint32)
 * CRC32C                            "sse4.2" or "software": how crc32c is computed here
 *     SSE4.2's crc32 instruction when the CPU has it (probed once, at import),
 *     four pages interleaved so the instruction's latency is hidden; otherwise
 *     slicing-by-8 tables (software=True forces them, for tests). The GIL is
 *     released while either runs. The code is native/common/crc32c.c, shared with _uring and _fetch.
 *
 * Up to queue_depth reads are kept in flight with Linux native AIO (io_setup /
 * io_submit / io_getevents as raw syscalls, completions reaped from the
 * user-mapped ring as libaio does; no libaio needed). With an O_DIRECT fd this
 * is what fio's libaio engine does. Offsets and lengths are int64
 * buffers; buffers must be aligned for O_DIRECT by the caller. A short read (end
 * of file) or an I/O error raises OSError naming the offset. Where the kernel
 * offers no AIO, reads run one by one with pread.
 *
 * Drained contexts are pooled (io_setup/io_destroy are slow). A context belongs
 * to the process that set it up: fork() does not copy its ring, so the child's
 * io_submit on it fails with EINVAL. The child therefore starts with an empty
 * pool (pthread_atfork) and sets up its own contexts.
 */
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"  /* crc32c, page checks; PAGE, MAX_CHECKED_PAGES */
#include "batch.h"   /* the calls' arguments and checks, the per-extent page check and row copy */
#include "aio.h"     /* batch_t, read_aio, read_sync, the context pool; AIO_MAX_QD */

#define MAX_QD AIO_MAX_QD  /* events of one AIO context; larger queue depths are clamped */
#define CTX_POOL 64        /* idle contexts kept: io_destroy waits for an RCU grace period (ms) */

static PyObject *run(batch_t *b, int qd) {  /* bytes read, or NULL with OSError set */
    if (qd < 1) qd = 1;
    if (qd > MAX_QD) qd = MAX_QD;
    int64_t total;
    Py_BEGIN_ALLOW_THREADS
    total = b->a.n ? read_aio(b, qd) : 0;
    if (total < 0) total = read_sync(b);
    Py_END_ALLOW_THREADS
    if (b->err) {
        if (b->short_read)
            return PyErr_Format(PyExc_OSError, "short read at offset %lld (file truncated?)", (long long)b->err_off);
        errno = b->err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(total);
}

static PyObject *read_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd, qd;
    PyObject *o_buf, *o_off, *o_len, *o_dst;
    if (!PyArg_ParseTuple(args, "iOOOOi", &fd, &o_buf, &o_off, &o_len, &o_dst, &qd)) return NULL;
    batch_t b = {.fd = fd};
    PyObject *result = NULL;
    if (batch_views_batch(&b.a, o_buf, o_off, o_len, o_dst) == 0 && batch_check_extents(&b.a, 0) == 0 &&
        batch_check_dst(&b.a) == 0)
        result = run(&b, qd);
    batch_release(&b.a);
    return result;
}

static PyObject *read_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd, qd;
    long long row_bytes;
    PyObject *o_out, *o_off, *o_len, *o_first, *o_roff, *o_scratch, *o_crcs = Py_None, *o_bad = Py_None;
    if (!PyArg_ParseTuple(args, "iOLOOOOOi|OO", &fd, &o_out, &row_bytes, &o_off, &o_len, &o_first, &o_roff, &o_scratch,
                          &qd, &o_crcs, &o_bad))
        return NULL;
    batch_t b = {.fd = fd};
    PyObject *result = NULL;
    if (batch_views_rows(&b.a, o_out, row_bytes, o_off, o_len, o_first, o_roff) < 0 ||
        batch_view(&b.a, o_scratch, 1, 0, "scratch") < 0 || batch_check_extents(&b.a, 0) < 0)
        goto done;
    if (qd < 1) qd = 1;
    if (qd > MAX_QD) qd = MAX_QD;
    const Py_buffer *scratch = &b.a.views[b.a.nviews - 1];
    b.a.scratch = scratch->buf;
    b.a.slot = batch_longest(&b.a);
    if (batch_check_rows(&b.a, (int64_t)qd * b.a.slot, scratch->len) < 0 || batch_check_pages(&b.a, o_crcs, o_bad) < 0)
        goto done;
    PyObject *got = run(&b, qd);
    if (got != NULL) {
        result = Py_BuildValue("(NL)", got, (long long)b.a.nbad);
    }
done:
    batch_release(&b.a);
    return result;
}

static PyObject *py_crc32c(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer v;
    unsigned long value = 0;
    int software = 0;
    if (!PyArg_ParseTuple(args, "y*|kp", &v, &value, &software)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c_any((uint32_t)value, v.buf, (size_t)v.len, crc32c_hw_available() && !software);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_page_crcs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_data, *o_out;
    int software = 0;
    if (!PyArg_ParseTuple(args, "OO|p", &o_data, &o_out, &software)) return NULL;
    batch_args_t views = {0};  /* only its buffer views */
    const Py_buffer *v = views.views;
    PyObject *result = NULL;
    if (batch_view(&views, o_data, 0, 0, "data") < 0 || batch_view(&views, o_out, 1, 0, "out") < 0) goto done;
    if (v[0].len % PAGE || v[1].itemsize != 4 || v[1].len / 4 != v[0].len / PAGE) {
        PyErr_Format(PyExc_ValueError, "page_crcs: data must be whole 4 KiB pages (%zd bytes) and out one uint32 per "
                     "page (%zd bytes, item size %zd)", v[0].len, v[1].len, v[1].itemsize);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    crc32c_pages_any(v[0].buf, v[0].len / PAGE, v[1].buf, crc32c_hw_available() && !software);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    batch_release(&views);
    return result;
}

static PyMethodDef methods[] = {
    {"read_batch", read_batch, METH_VARARGS,
     "read_batch(fd, buf, file_offsets, lengths, buf_offsets, queue_depth) -> bytes read"},
    {"read_rows", read_rows, METH_VARARGS,
     "read_rows(fd, out, row_bytes, file_offsets, lengths, first_row, row_offsets, scratch, queue_depth, "
     "page_crcs=None, bad=None) -> (bytes read, bad pages)"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0, software=False) -> int: crc32c of data, from value"},
    {"page_crcs", py_page_crcs, METH_VARARGS, "page_crcs(data, out, software=False): out[i] = crc32c of 4 KiB page i"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pread", "Batched O_DIRECT reads with Linux AIO.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pread(void) {
    aio_init(CTX_POOL);
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "CRC32C", crc32c_implementation()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
