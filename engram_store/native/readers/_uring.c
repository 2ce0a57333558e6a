/* Page reads through io_uring, driven by raw syscalls (no liburing), the GIL released.
 *
 * Ring(queue_depth, slot_bytes, sqpoll=False)
 *     One io_uring of queue_depth entries and its scratch: queue_depth slots of
 *     slot_bytes each (a multiple of 4 KiB), anonymous memory registered with the
 *     ring (IORING_REGISTER_BUFFERS) so reads into it are IORING_OP_READ_FIXED and
 *     the kernel does not pin and unpin pages per read. When registration is refused
 *     (RLIMIT_MEMLOCK) the slots are read into with IORING_OP_READ (fixed_buffers
 *     is then False).
 *
 * ring.read_rows(fd, out, row_bytes, file_offsets, lengths, first_row, row_offsets,
 *                page_crcs=None, bad=None, *, queue_depth=None, stop=None) -> (bytes read, bad pages)
 *     _pread.read_rows without its scratch and queue_depth arguments: extent i
 *     (lengths[i] <= slot_bytes bytes at file_offsets[i]) is read into a free slot
 *     and, as soon as it completes, rows first_row[i] .. first_row[i+1]-1 are copied
 *     into out (row r at out + r * row_bytes) from the slot at row_offsets[r]. With
 *     page_crcs (uint32, expected crc32c of every 4 KiB page of the file) each page
 *     is checked before any row is copied out of it; failing page numbers go into
 *     bad (int64) and their rows are not copied; the second item counts them.
 *     Checked extents must be whole pages, at most 64 each. queue_depth (at most the
 *     ring's, which is the default) caps this call's reads in flight. With stop (a buffer whose first
 *     int32 another thread may set non-zero: a reader that must give way), no read is queued once it
 *     is set; the reads in flight are waited for and the call returns (bytes read, bad pages, extents
 *     read): extents 0 .. that number - 1 were read (and their rows copied), the others not.
 * ring.read_batch(fd, buf, file_offsets, lengths, buf_offsets, *, queue_depth=None) -> bytes read
 *     _pread.read_batch without queue_depth: lengths[i] bytes at file_offsets[i]
 *     into buf[buf_offsets[i]:], queue_depth in flight (IORING_OP_READ: buf is the
 *     caller's, not registered).
 * ring.register_files(fds) / ring.unregister_files()
 *     Registers descriptors with the ring (IORING_REGISTER_FILES); reads of a
 *     registered fd then name it by its fixed index (IOSQE_FIXED_FILE), which saves
 *     the kernel a file lookup and reference per read. The ring keeps its own
 *     reference to each file: a batch on a registered fd first checks (fstat) that
 *     the number still names the file registered, and drops the registration
 *     otherwise, so closing an fd and reusing its number never reads the old file.
 * ring.close(); `with Ring(...) as ring:`.
 * probe() -> None when io_uring can read here, else a sentence saying why not.
 *
 * Either read raises OSError naming the offset on an I/O error or short read, after
 * every read in flight has completed. Up to queue_depth reads are in flight; new ones
 * are queued as soon as slots come back and each io_uring_enter both submits the
 * queued reads and waits for the next completion, so a batch costs about one
 * syscall per completion wake-up, not one per read.
 *
 * Attributes: queue_depth, slot_bytes, fixed_buffers, sqpoll, registered_files,
 * setup (what the kernel accepted), closed, usable (this process may read through it).
 *
 * Completions are run as task work of the reading thread without interrupting it
 * (IORING_SETUP_COOP_TASKRUN). The kernel's single-issuer modes (SINGLE_ISSUER,
 * DEFER_TASKRUN) are not asked for: they would tie a ring to one thread and, measured
 * on a virtio disk, cost more CPU per read (QD 64: 2.3 against 1.8 us; QD 16: 3.5
 * against 2.9 us). sqpoll=True adds a kernel thread polling the submission queue
 * (IORING_SETUP_SQPOLL, asleep after SQPOLL_IDLE_MS without work): reads are submitted
 * with no syscall, at the price of that thread's CPU (counted in the process's rusage;
 * 7 to 12 us per read on 2 cores): worth it only with cores to spare.
 *
 * Threads. A Ring serves one call at a time: a second thread calling it during a
 * batch gets RuntimeError. Any thread may use it between batches; readers keep one
 * Ring per thread so that no call waits for another.
 *
 * Fork. A ring's memory and fd are shared with a forked child, so the child must not
 * touch them: a Ring made before fork() raises RuntimeError in the child (a fork
 * generation counter bumped by pthread_atfork), which makes its own.
 *
 * One file for the one Ring type: its setup, submission, reaping and Python calls share the ring's
 * layout and state; the read calls' checks and page checks are batch.c's and crc32c.c's.
 */
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#define __NR_io_uring_enter 426
#define __NR_io_uring_register 427
#endif

#define MAX_QD 4096          /* slots are numbered in the low 16 bits of user_data */
#define MAX_FILES 4096       /* registered descriptors of one ring */
#define MAX_EXTENT 0x7ffff000 /* what one read(2) moves at most */
#define SQPOLL_IDLE_MS 50    /* the polling thread sleeps after this long with nothing to submit */

#include "crc32c.h"          /* page checks; PAGE, MAX_CHECKED_PAGES */
#include "batch.h"           /* the calls' arguments and checks, the per-extent page check and row copy */

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}
static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}
static int sys_register(int fd, unsigned op, const void *arg, unsigned nr) {
    return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

static unsigned long fork_generation = 0;  /* bumped in every forked child */
static void after_fork_in_child(void) { fork_generation++; }

typedef struct {
    PyObject_HEAD
    PyObject *weakrefs;                  /* a reader keeps weak references to the rings it made */
    int fd;                              /* the ring's fd; -1 once closed */
    unsigned setup_flags;                /* what the kernel accepted */
    int qd;
    int64_t slot_bytes;
    /* submission queue */
    void *sq_map; size_t sq_map_len;
    unsigned *sq_tail, *sq_flags, sq_mask;
    struct io_uring_sqe *sqes; size_t sqes_len;
    unsigned tail;                       /* our copy of *sq_tail */
    /* completion queue (in sq_map when the kernel offers IORING_FEAT_SINGLE_MMAP) */
    void *cq_map; size_t cq_map_len;
    unsigned *cq_head, *cq_tail, cq_mask;
    struct io_uring_cqe *cqes;
    /* scratch slots */
    char *scratch; size_t scratch_len;
    int fixed_buffers;                   /* the slots are registered buffers (buf_index = slot) */
    int *free_slots;
    /* registered files */
    int nfiles;
    int *file_fd;                        /* fixed index -> fd */
    dev_t *file_dev; ino_t *file_ino;    /* what each fd named when registered */
    /* ownership */
    unsigned long generation;            /* fork_generation when made */
    int busy;                            /* a batch is running (set and cleared with the GIL held) */
    int broken;                          /* a syscall failed with reads in flight: refuse further use */
} Ring;

/* --- one batch -------------------------------------------------------------------------- */
typedef struct {
    batch_args_t a;                  /* what the call asked for, checked (batch.h) */
    int fd, fixed;                   /* fd, or a fixed index when fixed */
    int qd;                          /* reads in flight at most */
    int64_t total;                   /* bytes read */
    int err; int64_t err_off; int short_read;  /* the first failure */
    int sys_err;                     /* a ring syscall failed (not a read): errno */
    const int32_t *stop;             /* NULL, or a flag another thread raises: queue no more reads */
    Py_ssize_t queued;               /* extents queued (in order: 0 .. queued - 1) */
} batch_t;

static int stop_raised(const batch_t *b) {
    return b->stop != NULL && __atomic_load_n(b->stop, __ATOMIC_RELAXED) != 0;
}

static void fail(batch_t *b, int err, int64_t off, int is_short) {
    if (!b->err) { b->err = err; b->err_off = off; b->short_read = is_short; }
}

static void queue_read(Ring *r, batch_t *b, Py_ssize_t i, int slot) {
    struct io_uring_sqe *sqe = &r->sqes[r->tail & r->sq_mask];
    memset(sqe, 0, sizeof(*sqe));
    sqe->flags = b->fixed ? IOSQE_FIXED_FILE : 0;
    sqe->fd = b->fd;
    sqe->off = (uint64_t)b->a.off[i];
    sqe->len = (uint32_t)b->a.len[i];
    sqe->user_data = (uint64_t)i << 16 | (uint64_t)slot;
    sqe->addr = (uint64_t)(uintptr_t)batch_target(&b->a, i, slot);
    if (b->a.scratch) {
        sqe->opcode = r->fixed_buffers ? IORING_OP_READ_FIXED : IORING_OP_READ;
        sqe->buf_index = r->fixed_buffers ? (uint16_t)slot : 0;
    } else {
        sqe->opcode = IORING_OP_READ;
    }
    r->tail++;
}

/* Handle every completion posted; returns how many. */
static int reap(Ring *r, batch_t *b, int *nfree) {
    unsigned head = *r->cq_head;  /* only we move it */
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    int got = 0;
    for (; head != tail; head++, got++) {
        const struct io_uring_cqe *cqe = &r->cqes[head & r->cq_mask];
        Py_ssize_t i = (Py_ssize_t)(cqe->user_data >> 16);
        int slot = (int)(cqe->user_data & 0xFFFF);
        int64_t res = cqe->res;
        if (res < 0) fail(b, (int)-res, b->a.off[i], 0);
        else if (res != b->a.len[i]) fail(b, EIO, b->a.off[i], 1);
        else { b->total += res; batch_complete(&b->a, i, slot); }
        r->free_slots[(*nfree)++] = slot;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return got;
}

/* Run a batch, queue_depth reads in flight; returns with none in flight unless broken. */
static void ring_run(Ring *r, batch_t *b) {
    int sqpoll = (r->setup_flags & IORING_SETUP_SQPOLL) != 0;
    int nfree = b->qd;
    for (int s = 0; s < b->qd; s++) r->free_slots[s] = b->qd - 1 - s;
    Py_ssize_t next = 0;
    int inflight = 0;     /* submitted, not yet completed */
    unsigned pending = 0; /* queued in the SQ, not yet consumed by io_uring_enter */
    for (;;) {
        while (next < b->a.n && nfree > 0 && !b->err && !stop_raised(b)) {
            queue_read(r, b, next++, r->free_slots[--nfree]);
            pending++;
        }
        b->queued = next;
        if (pending) __atomic_store_n(r->sq_tail, r->tail, __ATOMIC_RELEASE);
        if (sqpoll) { inflight += pending; pending = 0; }  /* the polling thread takes them from the ring */
        if (inflight + pending == 0) break;
        int ready = *r->cq_head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        unsigned flags = IORING_ENTER_GETEVENTS, wait = ready ? 0 : 1;  /* GETEVENTS also runs deferred completions */
        if (sqpoll) {
            __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the tail store before the flags load */
            if (__atomic_load_n(r->sq_flags, __ATOMIC_RELAXED) & IORING_SQ_NEED_WAKEUP) flags |= IORING_ENTER_SQ_WAKEUP;
        }
        if (pending || wait || (flags & IORING_ENTER_SQ_WAKEUP)) {
            int ret = sys_enter(r->fd, pending, wait, flags);
            if (ret < 0) {
                int e = errno;
                if (e == EINTR) continue;
                if ((e == EAGAIN || e == EBUSY) && inflight > 0) {  /* short of resources: reap, then retry */
                    ret = sys_enter(r->fd, 0, 1, IORING_ENTER_GETEVENTS);
                    if (ret >= 0 || errno == EINTR) { inflight -= reap(r, b, &nfree); continue; }
                    e = errno;
                }
                /* nothing was taken from the ring: give the queued reads back */
                r->tail -= pending;
                __atomic_store_n(r->sq_tail, r->tail, __ATOMIC_RELEASE);
                if (!b->sys_err) b->sys_err = e;
                while (inflight > 0) {  /* the reads in flight still write into slots or buf: wait for them */
                    if (sys_enter(r->fd, 0, 1, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR) break;
                    inflight -= reap(r, b, &nfree);
                }
                if (inflight > 0) r->broken = 1;
                return;
            }
            if (!sqpoll) {
                pending -= (unsigned)ret;
                inflight += ret;
            }
        }
        inflight -= reap(r, b, &nfree);
    }
}

/* --- the Ring type ------------------------------------------------------------------------ */
static void ring_release(Ring *r) {
    if (r->fd >= 0) {
        close(r->fd);  /* frees the registered buffers and files too */
        r->fd = -1;
    }
    if (r->sqes) munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map) munmap(r->sq_map, r->sq_map_len);
    if (r->scratch) munmap(r->scratch, r->scratch_len);
    r->sqes = NULL; r->cq_map = r->sq_map = NULL; r->scratch = NULL;
    PyMem_Free(r->free_slots); PyMem_Free(r->file_fd); PyMem_Free(r->file_dev); PyMem_Free(r->file_ino);
    r->free_slots = NULL; r->file_fd = NULL; r->file_dev = NULL; r->file_ino = NULL;
    r->nfiles = 0;
}

/* Set up the ring with the first flag set the kernel accepts; -1 with errno. */
static int ring_setup(Ring *r, int sqpoll) {
    unsigned tries[2];  /* COOP_TASKRUN needs 5.19 */
    int ntries = 0;
    if (sqpoll) {
        tries[ntries++] = IORING_SETUP_SQPOLL;
    } else {
        tries[ntries++] = IORING_SETUP_COOP_TASKRUN;
        tries[ntries++] = 0;
    }
    struct io_uring_params p;
    int fd = -1;
    for (int t = 0; t < ntries && fd < 0; t++) {
        memset(&p, 0, sizeof(p));
        p.flags = tries[t];
        if (sqpoll) p.sq_thread_idle = SQPOLL_IDLE_MS;
        fd = sys_setup((unsigned)r->qd, &p);
        if (fd < 0 && errno != EINVAL) return -1;
    }
    if (fd < 0) return -1;
    r->fd = fd;
    r->setup_flags = p.flags;

    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_map_len > r->sq_map_len) r->sq_map_len = r->cq_map_len;
    void *sq = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) return -1;
    r->sq_map = sq;
    void *cq = sq;
    if (!single) {
        cq = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED) return -1;
    }
    r->cq_map = cq;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    void *sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) return -1;
    r->sqes = sqes;

    char *s = sq, *c = cq;
    r->sq_tail = (unsigned *)(s + p.sq_off.tail);
    r->sq_flags = (unsigned *)(s + p.sq_off.flags);
    r->sq_mask = *(unsigned *)(s + p.sq_off.ring_mask);
    unsigned *array = (unsigned *)(s + p.sq_off.array);
    for (unsigned k = 0; k < p.sq_entries; k++) array[k] = k;  /* SQE k sits at index k, once for all */
    r->tail = *r->sq_tail;
    r->cq_head = (unsigned *)(c + p.cq_off.head);
    r->cq_tail = (unsigned *)(c + p.cq_off.tail);
    r->cq_mask = *(unsigned *)(c + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(c + p.cq_off.cqes);

    r->scratch_len = (size_t)r->qd * (size_t)r->slot_bytes;
    void *mem = mmap(NULL, r->scratch_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (mem == MAP_FAILED) return -1;
    r->scratch = mem;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)r->qd);
    if (iov == NULL) { errno = ENOMEM; return -1; }
    for (int k = 0; k < r->qd; k++) {
        iov[k].iov_base = r->scratch + (size_t)k * (size_t)r->slot_bytes;
        iov[k].iov_len = (size_t)r->slot_bytes;
    }
    r->fixed_buffers = sys_register(fd, IORING_REGISTER_BUFFERS, iov, (unsigned)r->qd) == 0;
    PyMem_Free(iov);
    return 0;
}

static int ring_init(Ring *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"queue_depth", "slot_bytes", "sqpoll", NULL};
    int qd, sqpoll = 0;
    long long slot_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iL|p", kwlist, &qd, &slot_bytes, &sqpoll)) return -1;
    if (r->fd >= 0 || r->sq_map) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.__init__ called twice");
        return -1;
    }
    if (qd < 1 || qd > MAX_QD) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be within 1..%d, got %d", MAX_QD, qd);
        return -1;
    }
    if (slot_bytes <= 0 || slot_bytes % PAGE || slot_bytes > MAX_EXTENT) {
        PyErr_Format(PyExc_ValueError, "slot_bytes must be a positive multiple of %d below 2 GiB, got %lld", PAGE,
                     slot_bytes);
        return -1;
    }
    r->qd = qd;
    r->slot_bytes = slot_bytes;
    r->generation = fork_generation;
    r->free_slots = PyMem_Malloc(sizeof(int) * (size_t)qd);
    if (r->free_slots == NULL) { PyErr_NoMemory(); return -1; }
    if (ring_setup(r, sqpoll) < 0) {
        int e = errno;
        ring_release(r);
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *ring_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds)) {
    Ring *r = (Ring *)type->tp_alloc(type, 0);
    if (r != NULL) r->fd = -1;
    return (PyObject *)r;
}

static void ring_dealloc(Ring *r) {
    if (r->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)r);
    ring_release(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* May this thread run a batch now? Sets r->busy; NULL return means an exception is set. */
static int ring_acquire(Ring *r) {
    if (r->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "Ring is closed");
        return -1;
    }
    if (r->generation != fork_generation) {
        PyErr_SetString(PyExc_RuntimeError, "this Ring was made before fork() and belongs to the parent process; "
                                            "make a new Ring in this one");
        return -1;
    }
    if (r->broken) {
        PyErr_SetString(PyExc_RuntimeError, "this Ring failed with reads in flight and cannot be used again; make a new one");
        return -1;
    }
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this Ring is in use by another thread; use one Ring per thread");
        return -1;
    }
    r->busy = 1;
    return 0;
}

/* The fixed index of fd, or -1: a registered fd whose number now names another file loses its registration. */
static int fixed_index(Ring *r, int fd) {
    for (int k = 0; k < r->nfiles; k++) {
        if (r->file_fd[k] != fd) continue;
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_dev == r->file_dev[k] && st.st_ino == r->file_ino[k]) return k;
        int none = -1;
        struct io_uring_files_update up = {.offset = (uint32_t)k, .fds = (uint64_t)(uintptr_t)&none};
        sys_register(r->fd, IORING_REGISTER_FILES_UPDATE, &up, 1);
        r->file_fd[k] = -1;
        return -1;
    }
    return -1;
}

/* Run b with the GIL released; returns bytes read, or NULL with OSError set. */
static PyObject *ring_batch(Ring *r, batch_t *b) {
    if (b->a.n) {
        Py_BEGIN_ALLOW_THREADS
        int k = fixed_index(r, b->fd);
        if (k >= 0) { b->fd = k; b->fixed = 1; }
        ring_run(r, b);
        Py_END_ALLOW_THREADS
    }
    r->busy = 0;
    if (b->sys_err) {
        errno = b->sys_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (b->err) {
        if (b->short_read)
            return PyErr_Format(PyExc_OSError, "short read at offset %lld (file truncated?)", (long long)b->err_off);
        errno = b->err;
        return PyErr_Format(PyExc_OSError, "[Errno %d] %s: read at offset %lld", b->err, strerror(b->err),
                            (long long)b->err_off);
    }
    return PyLong_FromLongLong(b->total);
}

/* --- the calls (their buffers are checked in batch.h, as _pread's are) -------------------------- */
/* queue_depth=None: the ring's; else 1..the ring's. */
static int call_qd(Ring *r, PyObject *o, int *qd) {
    if (o == Py_None) { *qd = r->qd; return 0; }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 1 || v > r->qd) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be within 1..%d (the ring's), got %ld", r->qd, v);
        return -1;
    }
    *qd = (int)v;
    return 0;
}

static PyObject *ring_read_batch(Ring *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "buf", "file_offsets", "lengths", "buf_offsets", "queue_depth", NULL};
    int fd;
    PyObject *o_buf, *o_off, *o_len, *o_dst, *o_qd = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOO|$O", kwlist, &fd, &o_buf, &o_off, &o_len, &o_dst, &o_qd))
        return NULL;
    batch_t b = {.fd = fd};
    PyObject *result = NULL;
    if (batch_views_batch(&b.a, o_buf, o_off, o_len, o_dst) == 0 && call_qd(r, o_qd, &b.qd) == 0 &&
        batch_check_extents(&b.a, MAX_EXTENT) == 0 && batch_check_dst(&b.a) == 0 && ring_acquire(r) == 0)
        result = ring_batch(r, &b);
    batch_release(&b.a);
    return result;
}

/* stop=None: none; else a buffer holding at least one int32, read (never written) while the batch runs. */
static int stop_view(batch_t *b, PyObject *o_stop) {
    if (o_stop == Py_None) return 0;
    if (batch_view(&b->a, o_stop, 0, 0, "stop") < 0) return -1;
    const Py_buffer *v = &b->a.views[b->a.nviews - 1];
    if (v->len < (Py_ssize_t)sizeof(int32_t) || (uintptr_t)v->buf % sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "stop must be an aligned buffer of at least one int32");
        return -1;
    }
    b->stop = v->buf;
    return 0;
}

static PyObject *ring_read_rows(Ring *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "out", "row_bytes", "file_offsets", "lengths", "first_row", "row_offsets",
                             "page_crcs", "bad", "queue_depth", "stop", NULL};
    int fd;
    long long row_bytes;
    PyObject *o_out, *o_off, *o_len, *o_first, *o_roff, *o_crcs = Py_None, *o_bad = Py_None, *o_qd = Py_None;
    PyObject *o_stop = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOLOOOO|OO$OO", kwlist, &fd, &o_out, &row_bytes, &o_off, &o_len,
                                     &o_first, &o_roff, &o_crcs, &o_bad, &o_qd, &o_stop))
        return NULL;
    batch_t b = {.fd = fd};
    PyObject *result = NULL;
    if (batch_views_rows(&b.a, o_out, row_bytes, o_off, o_len, o_first, o_roff) == 0 && call_qd(r, o_qd, &b.qd) == 0 &&
        batch_check_extents(&b.a, r->slot_bytes) == 0 && batch_check_rows(&b.a, 0, -1) == 0 &&
        batch_check_pages(&b.a, o_crcs, o_bad) == 0 && stop_view(&b, o_stop) == 0 && ring_acquire(r) == 0) {
        b.a.scratch = r->scratch; b.a.slot = r->slot_bytes;
        PyObject *got = ring_batch(r, &b);
        if (got != NULL && b.stop != NULL)
            result = Py_BuildValue("(NLn)", got, (long long)b.a.nbad, b.queued);
        else if (got != NULL)
            result = Py_BuildValue("(NL)", got, (long long)b.a.nbad);
    }
    batch_release(&b.a);
    return result;
}

static PyObject *ring_unregister_files(Ring *r, PyObject *Py_UNUSED(ignored)) {
    if (ring_acquire(r) < 0) return NULL;
    if (r->nfiles) sys_register(r->fd, IORING_UNREGISTER_FILES, NULL, 0);
    r->nfiles = 0;
    r->busy = 0;
    Py_RETURN_NONE;
}

static PyObject *ring_register_files(Ring *r, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "register_files needs a sequence of file descriptors");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = NULL;
    int *fds = NULL;
    dev_t *devs = NULL;
    ino_t *inos = NULL;
    if (n > MAX_FILES) {
        PyErr_Format(PyExc_ValueError, "register_files: at most %d descriptors, got %zd", MAX_FILES, n);
        goto done;
    }
    fds = PyMem_Malloc(sizeof(int) * (size_t)(n ? n : 1));
    devs = PyMem_Malloc(sizeof(dev_t) * (size_t)(n ? n : 1));
    inos = PyMem_Malloc(sizeof(ino_t) * (size_t)(n ? n : 1));
    if (fds == NULL || devs == NULL || inos == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, k));
        if (fd == -1 && PyErr_Occurred()) goto done;
        if (fd < 0 || fd > INT32_MAX) { PyErr_Format(PyExc_ValueError, "register_files: bad descriptor %ld", fd); goto done; }
        struct stat st;
        if (fstat((int)fd, &st) < 0) { PyErr_SetFromErrno(PyExc_OSError); goto done; }
        fds[k] = (int)fd; devs[k] = st.st_dev; inos[k] = st.st_ino;
    }
    if (ring_acquire(r) < 0) goto done;
    if (r->nfiles) sys_register(r->fd, IORING_UNREGISTER_FILES, NULL, 0);
    r->nfiles = 0;
    int rc = n ? sys_register(r->fd, IORING_REGISTER_FILES, fds, (unsigned)n) : 0;
    r->busy = 0;
    if (rc < 0) { PyErr_SetFromErrno(PyExc_OSError); goto done; }
    PyMem_Free(r->file_fd); PyMem_Free(r->file_dev); PyMem_Free(r->file_ino);
    r->file_fd = fds; r->file_dev = devs; r->file_ino = inos;
    fds = NULL; devs = NULL; inos = NULL;
    r->nfiles = (int)n;
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(fds); PyMem_Free(devs); PyMem_Free(inos);
    Py_DECREF(seq);
    return result;
}

static PyObject *ring_close(Ring *r, PyObject *Py_UNUSED(ignored)) {
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "cannot close a Ring while another thread reads through it");
        return NULL;
    }
    ring_release(r);
    Py_RETURN_NONE;
}

static PyObject *ring_enter(Ring *r, PyObject *Py_UNUSED(ignored)) { return Py_NewRef(r); }

static PyObject *ring_exit(Ring *r, PyObject *Py_UNUSED(args)) { return ring_close(r, NULL); }

static PyObject *ring_get_closed(Ring *r, void *Py_UNUSED(c)) { return PyBool_FromLong(r->fd < 0); }
static PyObject *ring_get_usable(Ring *r, void *Py_UNUSED(c)) {
    return PyBool_FromLong(r->fd >= 0 && !r->broken && r->generation == fork_generation);
}
static PyObject *ring_get_queue_depth(Ring *r, void *Py_UNUSED(c)) { return PyLong_FromLong(r->qd); }
static PyObject *ring_get_slot_bytes(Ring *r, void *Py_UNUSED(c)) { return PyLong_FromLongLong(r->slot_bytes); }
static PyObject *ring_get_fixed_buffers(Ring *r, void *Py_UNUSED(c)) { return PyBool_FromLong(r->fixed_buffers); }
static PyObject *ring_get_sqpoll(Ring *r, void *Py_UNUSED(c)) {
    return PyBool_FromLong((r->setup_flags & IORING_SETUP_SQPOLL) != 0);
}

static PyObject *ring_get_registered_files(Ring *r, void *Py_UNUSED(c)) {
    PyObject *t = PyTuple_New(r->nfiles);
    for (int k = 0; t != NULL && k < r->nfiles; k++) PyTuple_SET_ITEM(t, k, PyLong_FromLong(r->file_fd[k]));
    return t;
}

static PyObject *ring_get_setup(Ring *r, void *Py_UNUSED(c)) {
    char s[160] = "";
    if (r->setup_flags & IORING_SETUP_SQPOLL) strcat(s, "sqpoll,");
    if (r->setup_flags & IORING_SETUP_COOP_TASKRUN) strcat(s, "coop_taskrun,");
    if (r->fixed_buffers) strcat(s, "fixed_buffers,");
    size_t n = strlen(s);
    if (n) s[n - 1] = '\0';
    return PyUnicode_FromString(s);
}

static PyMethodDef ring_methods[] = {
    {"read_rows", (PyCFunction)(void (*)(void))ring_read_rows, METH_VARARGS | METH_KEYWORDS,
     "read_rows(fd, out, row_bytes, file_offsets, lengths, first_row, row_offsets, page_crcs=None, bad=None, *, "
     "queue_depth=None, stop=None) -> (bytes read, bad pages[, extents read when stop is given])"},
    {"read_batch", (PyCFunction)(void (*)(void))ring_read_batch, METH_VARARGS | METH_KEYWORDS,
     "read_batch(fd, buf, file_offsets, lengths, buf_offsets, *, queue_depth=None) -> bytes read"},
    {"register_files", (PyCFunction)ring_register_files, METH_O,
     "register_files(fds): reads of these descriptors use their fixed index (replaces any earlier set)"},
    {"unregister_files", (PyCFunction)ring_unregister_files, METH_NOARGS, "unregister_files(): drop the registered set"},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "close(): free the ring and its slots (idempotent)"},
    {"__enter__", (PyCFunction)ring_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)ring_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ring_getset[] = {
    {"closed", (getter)ring_get_closed, NULL, "True once closed", NULL},
    {"usable", (getter)ring_get_usable, NULL, "open, not broken, and made in this process", NULL},
    {"queue_depth", (getter)ring_get_queue_depth, NULL, "reads in flight at most", NULL},
    {"slot_bytes", (getter)ring_get_slot_bytes, NULL, "bytes of one scratch slot (longest read_rows extent)", NULL},
    {"fixed_buffers", (getter)ring_get_fixed_buffers, NULL, "the slots are registered buffers (READ_FIXED)", NULL},
    {"sqpoll", (getter)ring_get_sqpoll, NULL, "a kernel thread polls the submission queue", NULL},
    {"registered_files", (getter)ring_get_registered_files, NULL, "registered fds, by fixed index (-1: dropped)", NULL},
    {"setup", (getter)ring_get_setup, NULL, "what the kernel accepted, comma-separated", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engram_store.native._uring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_weaklistoffset = offsetof(Ring, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(queue_depth, slot_bytes, sqpoll=False): an io_uring page reader",
    .tp_new = ring_new,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

/* --- module ------------------------------------------------------------------------------------ */
static PyObject *py_probe(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int fd = sys_setup(4, &p);
    if (fd < 0) {
        int e = errno;
        const char *hint = e == ENOSYS ? " (kernel built without io_uring)"
                           : e == EPERM ? " (disabled: see /proc/sys/kernel/io_uring_disabled, or a seccomp filter)"
                                        : "";
        return PyUnicode_FromFormat("io_uring_setup failed: %s%s", strerror(e), hint);
    }
    size_t len = sizeof(struct io_uring_probe) + IORING_OP_LAST * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *pr = PyMem_Calloc(1, len);
    PyObject *why = NULL;
    if (pr == NULL) {
        close(fd);
        return PyErr_NoMemory();
    }
    if (sys_register(fd, IORING_REGISTER_PROBE, pr, IORING_OP_LAST) < 0)
        why = PyUnicode_FromFormat("IORING_REGISTER_PROBE failed: %s (kernel older than 5.6)", strerror(errno));
    else if (pr->last_op < IORING_OP_READ || !(pr->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
             !(pr->ops[IORING_OP_READ_FIXED].flags & IO_URING_OP_SUPPORTED))
        why = PyUnicode_FromString("io_uring lacks IORING_OP_READ or IORING_OP_READ_FIXED (kernel older than 5.6)");
    PyMem_Free(pr);
    close(fd);
    return why ? why : Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"probe", py_probe, METH_NOARGS, "probe() -> None when io_uring reads work here, else why not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_uring", "O_DIRECT page reads through io_uring (raw syscalls).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__uring(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    crc_init();
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_QUEUE_DEPTH", MAX_QD) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C", crc32c_implementation()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
