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
#include "batch.h"   /* the calls' arguments and checks, the per-extent page check and row copy */

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
    batch_args_t a;                  /* what the call asked for, checked (batch.h) */
    int fd;
    int err;                         /* errno of the first failure, 0 if none */
    int64_t err_off;                 /* file offset of the first failure */
    int short_read;                  /* the failure was a short read */
} batch_t;

static void fail(batch_t *b, int err, int64_t off, int is_short) {
    if (!b->err) { b->err = err; b->err_off = off; b->short_read = is_short; }
}

static int64_t read_sync(batch_t *b) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < b->a.n && !b->err; i++) {
        char *dst = batch_target(&b->a, i, 0);
        int64_t done = 0;
        while (done < b->a.len[i]) {
            ssize_t r = pread(b->fd, dst + done, (size_t)(b->a.len[i] - done), b->a.off[i] + done);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) { fail(b, errno, b->a.off[i], 0); break; }
            if (r == 0) { fail(b, EIO, b->a.off[i], 1); break; }
            done += r;
        }
        if (!b->err) batch_complete(&b->a, i, 0);
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
    while ((next < b->a.n && !b->err) || inflight > 0) {
        long batch = 0;
        while (next < b->a.n && nfree > 0 && !b->err) {
            int slot = free_idx[--nfree];
            struct iocb *cb = &cbs[slot];
            memset(cb, 0, sizeof(*cb));
            cb->aio_fildes = (uint32_t)b->fd;
            cb->aio_lio_opcode = IOCB_CMD_PREAD;
            cb->aio_buf = (uint64_t)(uintptr_t)batch_target(&b->a, next, slot);
            cb->aio_nbytes = (uint64_t)b->a.len[next];
            cb->aio_offset = b->a.off[next];
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
            if (res < 0) fail(b, (int)-res, b->a.off[i], 0);
            else if (res != b->a.len[i]) fail(b, EIO, b->a.off[i], 1);
            else { total += res; batch_complete(&b->a, i, slot); }
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
    crc = crc32c_any((uint32_t)value, v.buf, (size_t)v.len, crc_hw && !software);
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
    crc32c_pages_any(v[0].buf, v[0].len / PAGE, v[1].buf, crc_hw && !software);
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
    pthread_atfork(NULL, NULL, reset_pool_in_child);
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "CRC32C", crc_hw ? "sse4.2" : "software") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
