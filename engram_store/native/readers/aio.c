/* Linux native AIO for a batch_t (aio.h): raw syscalls, completions reaped from the user-mapped ring. */
#include "aio.h"

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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
static aio_context_t pool[AIO_MAX_POOL];
static int pool_n = 0, pool_keep = 0;

static int ctx_get(aio_context_t *ctx) {
    pthread_mutex_lock(&pool_lock);
    if (pool_n > 0) {
        *ctx = pool[--pool_n];
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    pthread_mutex_unlock(&pool_lock);
    *ctx = 0;
    return sys_io_setup(AIO_MAX_QD, ctx) < 0 ? -1 : 0;
}

/* fork() copies only the calling thread and none of the AIO rings: the child forgets the
   parent's contexts (they are not its to destroy) and the lock another thread may have held. */
static void reset_pool_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pool_n = 0;
}

void aio_init(int keep) {
    pool_keep = keep < AIO_MAX_POOL ? keep : AIO_MAX_POOL;
    pthread_atfork(NULL, NULL, reset_pool_in_child);
}

/* Keep a drained context for the next call; destroy one with reads still in flight. */
static void ctx_put(aio_context_t ctx, int drained) {
    if (drained) {
        pthread_mutex_lock(&pool_lock);
        if (pool_n < pool_keep) {
            pool[pool_n++] = ctx;
            ctx = 0;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    if (ctx) sys_io_destroy(ctx);
}

static int cancelled(batch_t *b) {
    if (b->cancel == NULL || !__atomic_load_n(b->cancel, __ATOMIC_RELAXED)) return 0;
    b->cancelled = 1;
    return 1;
}

static void fail(batch_t *b, int err, int64_t off, int is_short) {
    if (!b->err) { b->err = err; b->err_off = off; b->short_read = is_short; }
}

int64_t read_sync(batch_t *b) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < b->a.n && !b->err && !cancelled(b); i++) {
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

int64_t read_aio(batch_t *b, int qd) {
    aio_context_t ctx = 0;
    if (ctx_get(&ctx) < 0) return -1;
    struct iocb cbs[AIO_MAX_QD];
    struct iocb *ptrs[AIO_MAX_QD];
    struct io_event events[AIO_MAX_QD];
    int free_idx[AIO_MAX_QD];
    int nfree = qd;
    for (int i = 0; i < qd; i++) free_idx[i] = qd - 1 - i;
    Py_ssize_t next = 0;
    long inflight = 0;
    int64_t total = 0;
    while ((next < b->a.n && !b->err && !cancelled(b)) || inflight > 0) {
        long batch = 0;
        while (next < b->a.n && nfree > 0 && !b->err && !cancelled(b)) {
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
