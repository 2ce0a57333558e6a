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
 *     released while either runs. The code is native/crc32c.h, shared with _uring.c.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_QD 256   /* events of one AIO context; larger queue depths are clamped */
#define CTX_POOL 64  /* idle contexts kept: io_destroy waits for an RCU grace period (ms) */

#include "crc32c.h"  /* crc32c, page checks; PAGE, MAX_CHECKED_PAGES */

static long sys_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(SYS_io_setup, nr, ctx); }
static long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
static long sys_io_submit(aio_context_t ctx, long n, struct iocb **iocbs) { return syscall(SYS_io_submit, ctx, n, iocbs); }
static long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *ev) {
    return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, NULL);
}

/* The completion ring the kernel maps at the context address. */
struct aio_ring {
    unsigned id, nr, head, tail, magic, compat_features, incompat_features, header_length;
    struct io_event events[];
};
#define AIO_RING_MAGIC 0xa10a10a1

/* Reap up to max completions without a syscall when the ring is readable. */
static long reap(aio_context_t ctx, long max, struct io_event *out) {
    struct aio_ring *ring = (struct aio_ring *)(uintptr_t)ctx;
    if (ring == NULL || ring->magic != AIO_RING_MAGIC || ring->incompat_features != 0)
        return sys_io_getevents(ctx, 1, max, out);
    long got = 0;
    while (got < max) {
        unsigned head = ring->head, tail = __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE);
        if (head == tail) break;
        out[got++] = ring->events[head % ring->nr];
        __atomic_store_n(&ring->head, (head + 1) % ring->nr, __ATOMIC_RELEASE);
    }
    return got ? got : sys_io_getevents(ctx, 1, max, out);
}

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static aio_context_t pool[CTX_POOL];
static int pool_n = 0;

static int ctx_get(aio_context_t *ctx) {
    pthread_mutex_lock(&pool_lock);
    if (pool_n > 0) {
        *ctx = pool[--pool_n];
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    pthread_mutex_unlock(&pool_lock);
    *ctx = 0;
    return sys_io_setup(MAX_QD, ctx) < 0 ? -1 : 0;
}

/* fork() copies only the calling thread and none of the AIO rings: the child forgets the
   parent's contexts (they are not its to destroy) and the lock another thread may have held. */
static void reset_pool_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pool_n = 0;
}

/* Keep a drained context for the next call; destroy one with reads still in flight. */
static void ctx_put(aio_context_t ctx, int drained) {
    if (drained) {
        pthread_mutex_lock(&pool_lock);
        if (pool_n < CTX_POOL) {
            pool[pool_n++] = ctx;
            ctx = 0;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    if (ctx) sys_io_destroy(ctx);
}

typedef struct {
    int fd;
    Py_ssize_t n;                    /* extents */
    const int64_t *off, *len;
    char *buf; const int64_t *dst;   /* read_batch: destination of each extent */
    char *scratch; int64_t slot;     /* read_rows: slot buffers of `slot` bytes */
    char *out; int64_t row_bytes;
    const int64_t *first_row, *row_off;
    const uint32_t *crcs; int64_t ncrcs;  /* read_rows: expected crc32c per page of the file, or NULL */
    int64_t *bad; int64_t nbad;      /* read_rows: page numbers that failed their check */
    int err;                         /* errno of the first failure, 0 if none */
    int64_t err_off;                 /* file offset of the first failure */
    int short_read;                  /* the failure was a short read */
} batch_t;

static void fail(batch_t *b, int err, int64_t off, int is_short) {
    if (!b->err) { b->err = err; b->err_off = off; b->short_read = is_short; }
}

static char *target(batch_t *b, Py_ssize_t i, int slot) {
    return b->scratch ? b->scratch + (int64_t)slot * b->slot : b->buf + b->dst[i];
}

/* Extent i has arrived in its slot: check its pages (when crcs are given), then copy out the
   rows of the pages that passed. */
static void complete(batch_t *b, Py_ssize_t i, int slot) {
    if (!b->scratch) return;
    const char *src = b->scratch + (int64_t)slot * b->slot;
    uint64_t bad_mask = 0;
    if (b->crcs)
        bad_mask = crc32c_check_pages((const uint8_t *)src, b->off[i] / PAGE, b->len[i] / PAGE, b->crcs, b->bad, &b->nbad);
    for (int64_t r = b->first_row[i]; r < b->first_row[i + 1]; r++)
        if (!bad_mask || !(bad_mask >> (b->row_off[r] / PAGE) & 1))
            memcpy(b->out + r * b->row_bytes, src + b->row_off[r], (size_t)b->row_bytes);
}

static int64_t read_sync(batch_t *b) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < b->n && !b->err; i++) {
        char *dst = target(b, i, 0);
        int64_t done = 0;
        while (done < b->len[i]) {
            ssize_t r = pread(b->fd, dst + done, (size_t)(b->len[i] - done), b->off[i] + done);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) { fail(b, errno, b->off[i], 0); break; }
            if (r == 0) { fail(b, EIO, b->off[i], 1); break; }
            done += r;
        }
        if (!b->err) complete(b, i, 0);
        total += done;
    }
    return total;
}

/* Returns bytes read, or -1 when AIO is unavailable (caller falls back). */
static int64_t read_aio(batch_t *b, int qd) {
    aio_context_t ctx = 0;
    if (ctx_get(&ctx) < 0) return -1;
    struct iocb cbs[MAX_QD];
    struct iocb *ptrs[MAX_QD];
    struct io_event events[MAX_QD];
    int free_idx[MAX_QD];
    int nfree = qd;
    for (int i = 0; i < qd; i++) free_idx[i] = qd - 1 - i;
    Py_ssize_t next = 0;
    long inflight = 0;
    int64_t total = 0;
    while ((next < b->n && !b->err) || inflight > 0) {
        long batch = 0;
        while (next < b->n && nfree > 0 && !b->err) {
            int slot = free_idx[--nfree];
            struct iocb *cb = &cbs[slot];
            memset(cb, 0, sizeof(*cb));
            cb->aio_fildes = (uint32_t)b->fd;
            cb->aio_lio_opcode = IOCB_CMD_PREAD;
            cb->aio_buf = (uint64_t)(uintptr_t)target(b, next, slot);
            cb->aio_nbytes = (uint64_t)b->len[next];
            cb->aio_offset = b->off[next];
            cb->aio_data = (uint64_t)next;
            ptrs[batch++] = cb;
            next++;
        }
        long sent = 0;
        while (sent < batch) {
            long r = sys_io_submit(ctx, batch - sent, ptrs + sent);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno == EAGAIN && inflight + sent > 0) break;  /* reap first */
            if (r < 0) { fail(b, errno, (int64_t)ptrs[sent]->aio_offset, 0); break; }
            sent += r;
        }
        if (sent < batch) {  /* not submitted: give the slots back, resubmit later */
            next = (Py_ssize_t)ptrs[sent]->aio_data;
            for (long k = sent; k < batch; k++) free_idx[nfree++] = (int)(ptrs[k] - cbs);
        }
        inflight += sent;
        if (inflight == 0) break;
        long got = reap(ctx, inflight, events);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { fail(b, errno, 0, 0); break; }
        for (long k = 0; k < got; k++) {
            int slot = (int)((struct iocb *)(uintptr_t)events[k].obj - cbs);
            Py_ssize_t i = (Py_ssize_t)events[k].data;
            int64_t res = (int64_t)events[k].res;
            if (res < 0) fail(b, (int)-res, b->off[i], 0);
            else if (res != b->len[i]) fail(b, EIO, b->off[i], 1);
            else { total += res; complete(b, i, slot); }
            free_idx[nfree++] = slot;
        }
        inflight -= got;
    }
    ctx_put(ctx, inflight == 0);
    return total;
}

static PyObject *run(batch_t *b, int qd) {  /* bytes read, or NULL with OSError set */
    if (qd < 1) qd = 1;
    if (qd > MAX_QD) qd = MAX_QD;
    int64_t total;
    Py_BEGIN_ALLOW_THREADS
    total = b->n ? read_aio(b, qd) : 0;
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

#define MAX_VIEWS 8

static int get_view(PyObject *obj, Py_buffer *views, int *nviews, int writable, int int64, const char *name) {
    Py_buffer *v = &views[*nviews];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    (*nviews)++;
    if (int64 && (v->itemsize != 8 || v->len % 8)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 buffer", name);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *views, int nviews) {
    for (int i = 0; i < nviews; i++) PyBuffer_Release(&views[i]);
}

static int check_extents(batch_t *b, Py_ssize_t n_len) {
    if (n_len != b->n) {
        PyErr_SetString(PyExc_ValueError, "file_offsets and lengths must have one length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->off[i] < 0 || b->len[i] <= 0) {
            PyErr_Format(PyExc_ValueError, "extent %zd: offset %lld, length %lld", i, (long long)b->off[i], (long long)b->len[i]);
            return -1;
        }
    }
    return 0;
}

static PyObject *read_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd, qd;
    PyObject *o_buf, *o_off, *o_len, *o_dst;
    if (!PyArg_ParseTuple(args, "iOOOOi", &fd, &o_buf, &o_off, &o_len, &o_dst, &qd)) return NULL;
    Py_buffer v[MAX_VIEWS];
    int nv = 0;
    PyObject *result = NULL;
    if (get_view(o_buf, v, &nv, 1, 0, "buf") < 0 || get_view(o_off, v, &nv, 0, 1, "file_offsets") < 0 ||
        get_view(o_len, v, &nv, 0, 1, "lengths") < 0 || get_view(o_dst, v, &nv, 0, 1, "buf_offsets") < 0)
        goto done;
    batch_t b = {0};
    b.fd = fd;
    b.n = v[1].len / 8;
    b.off = v[1].buf; b.len = v[2].buf; b.buf = v[0].buf; b.dst = v[3].buf;
    if (check_extents(&b, v[2].len / 8) < 0) goto done;
    if (v[3].len / 8 != b.n) { PyErr_SetString(PyExc_ValueError, "buf_offsets must match file_offsets"); goto done; }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (b.dst[i] < 0 || b.dst[i] + b.len[i] > v[0].len) {
            PyErr_Format(PyExc_ValueError, "read %zd (%lld bytes to %lld) is outside the %zd-byte buffer",
                         i, (long long)b.len[i], (long long)b.dst[i], v[0].len);
            goto done;
        }
    }
    result = run(&b, qd);
done:
    release(v, nv);
    return result;
}

static PyObject *read_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd, qd;
    long long row_bytes;
    PyObject *o_out, *o_off, *o_len, *o_first, *o_roff, *o_scratch, *o_crcs = Py_None, *o_bad = Py_None;
    if (!PyArg_ParseTuple(args, "iOLOOOOOi|OO", &fd, &o_out, &row_bytes, &o_off, &o_len, &o_first, &o_roff, &o_scratch,
                          &qd, &o_crcs, &o_bad))
        return NULL;
    Py_buffer v[MAX_VIEWS];
    int nv = 0;
    PyObject *result = NULL;
    if (get_view(o_out, v, &nv, 1, 0, "out") < 0 || get_view(o_off, v, &nv, 0, 1, "file_offsets") < 0 ||
        get_view(o_len, v, &nv, 0, 1, "lengths") < 0 || get_view(o_first, v, &nv, 0, 1, "first_row") < 0 ||
        get_view(o_roff, v, &nv, 0, 1, "row_offsets") < 0 || get_view(o_scratch, v, &nv, 1, 0, "scratch") < 0)
        goto done;
    batch_t b = {0};
    b.fd = fd;
    b.n = v[1].len / 8;
    b.off = v[1].buf; b.len = v[2].buf; b.out = v[0].buf; b.row_bytes = row_bytes;
    b.first_row = v[3].buf; b.row_off = v[4].buf; b.scratch = v[5].buf;
    if (check_extents(&b, v[2].len / 8) < 0) goto done;
    if (qd < 1) qd = 1;
    if (qd > MAX_QD) qd = MAX_QD;
    Py_ssize_t rows = v[4].len / 8;
    int64_t longest = 0;
    for (Py_ssize_t i = 0; i < b.n; i++) longest = b.len[i] > longest ? b.len[i] : longest;
    b.slot = longest;
    if (row_bytes <= 0 || v[3].len / 8 != b.n + 1 || rows * row_bytes > v[0].len || (int64_t)qd * longest > v[5].len) {
        PyErr_SetString(PyExc_ValueError, "read_rows: first_row needs n+1 entries, out rows * row_bytes bytes, "
                                          "scratch queue_depth * max(lengths) bytes");
        goto done;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (b.first_row[i] < 0 || b.first_row[i] > b.first_row[i + 1] || b.first_row[i + 1] > rows) {
            PyErr_Format(PyExc_ValueError, "read_rows: first_row must be non-decreasing within [0, %zd]", rows);
            goto done;
        }
        for (int64_t r = b.first_row[i]; r < b.first_row[i + 1]; r++) {
            if (b.row_off[r] < 0 || b.row_off[r] + row_bytes > b.len[i]) {
                PyErr_Format(PyExc_ValueError, "read_rows: row %lld at %lld is outside extent %zd", (long long)r,
                             (long long)b.row_off[r], i);
                goto done;
            }
        }
    }
    if (o_crcs != Py_None) {
        if ((o_bad == Py_None) || get_view(o_crcs, v, &nv, 0, 0, "page_crcs") < 0 ||
            get_view(o_bad, v, &nv, 1, 1, "bad") < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read_rows: page_crcs needs a bad buffer too");
            goto done;
        }
        if (v[6].itemsize != 4 || v[6].len % 4) {
            PyErr_SetString(PyExc_TypeError, "page_crcs must be a uint32 buffer");
            goto done;
        }
        b.crcs = v[6].buf; b.ncrcs = v[6].len / 4; b.bad = v[7].buf;
        int64_t pages = 0;
        for (Py_ssize_t i = 0; i < b.n; i++) {
            if (b.off[i] % PAGE || b.len[i] % PAGE || b.len[i] > MAX_CHECKED_PAGES * PAGE ||
                (b.off[i] + b.len[i]) / PAGE > b.ncrcs) {
                PyErr_Format(PyExc_ValueError, "read_rows: checked extent %zd (%lld bytes at %lld) must be whole pages, "
                             "at most %d, inside the %lld pages page_crcs covers", i, (long long)b.len[i],
                             (long long)b.off[i], MAX_CHECKED_PAGES, (long long)b.ncrcs);
                goto done;
            }
            pages += b.len[i] / PAGE;
        }
        if (v[7].len / 8 < pages) {
            PyErr_Format(PyExc_ValueError, "read_rows: bad holds %zd entries, %lld pages are read", v[7].len / 8,
                         (long long)pages);
            goto done;
        }
    }
    PyObject *got = run(&b, qd);
    if (got != NULL) {
        result = Py_BuildValue("(NL)", got, (long long)b.nbad);
    }
done:
    release(v, nv);
    return result;
}

static PyObject *py_crc32c(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer v;
    unsigned long value = 0;
    int software = 0;
    if (!PyArg_ParseTuple(args, "y*|kp", &v, &value, &software)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c_any((uint32_t)value, v.buf, (size_t)v.len, crc_hw && !software);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_page_crcs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_data, *o_out;
    int software = 0;
    if (!PyArg_ParseTuple(args, "OO|p", &o_data, &o_out, &software)) return NULL;
    Py_buffer v[2];
    int nv = 0;
    PyObject *result = NULL;
    if (get_view(o_data, v, &nv, 0, 0, "data") < 0 || get_view(o_out, v, &nv, 1, 0, "out") < 0) goto done;
    if (v[0].len % PAGE || v[1].itemsize != 4 || v[1].len / 4 != v[0].len / PAGE) {
        PyErr_Format(PyExc_ValueError, "page_crcs: data must be whole 4 KiB pages (%zd bytes) and out one uint32 per "
                     "page (%zd bytes, item size %zd)", v[0].len, v[1].len, v[1].itemsize);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    crc32c_pages_any(v[0].buf, v[0].len / PAGE, v[1].buf, crc_hw && !software);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(v, nv);
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
    pthread_atfork(NULL, NULL, reset_pool_in_child);
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "CRC32C", crc_hw ? "sse4.2" : "software") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
