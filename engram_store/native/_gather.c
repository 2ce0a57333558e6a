/* Row gathers from a DRAM arena, split across a small pool of native threads.
 *
 * gather(src, row_bytes, index, out, threads=1) -> None
 *     out[i] = src[index[i]] for rows of row_bytes bytes.
 * take_int32(table, index, out) -> None, bump_uint8(counts, index, cap) -> None
 *     The row cache's per-lookup bookkeeping: row-to-slot entries read at random rows
 *     (prefetched), hit counts raised up to a cap (numpy's semantics for repeated indices).
 *     On the caller's thread, the GIL released.
 * EpochGuard()
 *     The row cache's lock and reader epochs, shared with the daemon's native path (epoch_guard.h).
 * gather_to_split(...), gather_split_to_split(...), gate_claim(...), gate_done(...)
 *     Rows into a client's staging in the engines' split layout, row i at positions[i] (one host
 *     copy: engram_store/wire/staging.py), and the staging's gate (staging_gate.h).
 * gather_split(weights, weight_bytes, scales, scale_bytes, index, out, threads=1) -> None
 *     The same for a table kept in two blocks, the engines' layout (every row's
 *     payload in one block, every row's scales in the other): out[i] is
 *     weights[index[i]] followed by scales[index[i]], weight_bytes + scale_bytes
 *     bytes, i.e. the row as it is stored on disk. Rows are copied in
 *     blocks of BLOCK_ROWS; up to `threads` threads (the caller plus pool
 *     workers) claim blocks from a shared counter, so a worker that the
 *     scheduler delays simply takes fewer blocks. Each thread software-prefetches
 *     rows a few indices ahead so that cache and TLB misses overlap: a random
 *     gather over a large table is bound by memory latency, not bandwidth.
 *     An index outside [0, rows) raises IndexError before anything is copied.
 *
 * The pool is created on first use and grows to the largest `threads` asked
 * for (at most MAX_WORKERS + 1). It serves one gather at a time: a caller that
 * finds it busy copies on its own thread instead of waiting. Idle workers spin
 * for a few microseconds after a job (back-to-back requests then start at
 * once) and sleep on a futex after that, so an idle pool costs no CPU;
 * prime() wakes them ahead of a gather that is about to come.
 * A child process after fork() starts with no workers and grows its own pool.
 *
 * Why not the Python thread pool: a hand-off through it costs tens of
 * microseconds of GIL and condition-variable traffic per part, which is the
 * whole budget of a decode-sized gather.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_gather_api.h"
#include "epoch_guard.h"  /* EpochGuard: the row cache's lock and reader epochs */
#include "staging_gate.h" /* gate_claim, gate_done: a client staging's gate (the daemon's Python path) */

#define BLOCK_ROWS 1024     /* rows per claim: small enough to balance, large enough to amortize */
#define MIN_SPLIT_ROWS 2048 /* smaller gathers run on the caller's thread */
#define MAX_WORKERS 15
#define PREFETCH_AHEAD 12
/* Split tables (the resident arena) cost two misses per row, one in each block, and on
   4 KiB pages each a page walk. The first line of a payload is prefetched far ahead, which
   starts its page walk early, and the rest of it nearer, when the translation is cached;
   scales are copied in a second pass over each chunk of rows (copy_split). Measured against
   one pass prefetching whole payloads 24 and scales 48 rows ahead (bench/gather_micro.py
   tables, one thread, 6,144 random rows, paired in one process): 1.2-1.3x as fast on 4 KiB
   shmem pages, rows in L3 or not, 1.14-1.25x on transparent huge pages, 196,608 rows 1.05x;
   the far touch alone gave 1.18x. Through bench/lookup.py (same arena): 1.02-1.05x. */
#define SPLIT_TOUCH_AHEAD 64
#define SPLIT_ROW_AHEAD 16
#define SPLIT_SCALES_AHEAD 64
#define SPLIT_CHUNK_ROWS 1024
#define IDLE_SPIN_NS 50000  /* how long an idle worker spins before it sleeps */

typedef struct {
    const char *src;   /* row r at src + r * row_bytes */
    const char *src2;  /* split tables: its second part at src2 + r * row_bytes2; NULL otherwise */
    const int64_t *idx;
    char *out;         /* row i at out + i * (row_bytes + row_bytes2) */
    size_t row_bytes, row_bytes2;
    int64_t n, rows, nblocks;
    /* split outputs (a client's staging) instead of out: row i's first row_bytes at wout + pos[i] * row_bytes,
       the rest at sout + pos[i] * row_bytes2; a packed src then holds rows of row_bytes + row_bytes2 */
    const int64_t *pos;
    char *wout, *sout;
} job_t;

/* The one job in flight. `claim` packs (generation << 32 | next block); a worker
 * may take a block only while the generation is the one it woke for, so a late
 * worker never touches a finished job. `done` counts finished blocks. */
static job_t job;
static _Atomic uint64_t claim;
static _Atomic int64_t done;
static _Atomic uint32_t generation; /* futex word the workers sleep on */
static _Atomic int workers_wanted;  /* workers that take part in the current generation */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int n_workers;
static _Atomic uint32_t nudge;

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Position of the first index in [lo, hi) outside [0, rows), or -1. */
static int64_t first_out_of_range(const job_t *j, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++)
        if ((uint64_t)j->idx[i] >= (uint64_t)j->rows) return i;
    return -1;
}

static inline void prefetch_row(const char *p, size_t rb) {
    /* Locality 3 (into every cache level): memcpy reads the row a few iterations
       later. The non-temporal hint measured 2.5x slower. */
    for (size_t off = 0; off < rb; off += 64) __builtin_prefetch(p + off, 0, 3);
    __builtin_prefetch(p + rb - 1, 0, 3);
}

/* Every cache line that [from, end) touches. */
static inline void prefetch_lines(uintptr_t from, uintptr_t end) {
    for (uintptr_t line = from & ~(uintptr_t)63; line < end; line += 64) __builtin_prefetch((const char *)line, 0, 3);
}

/* Rows of a split table: out row i = weights[idx[i]] ++ scales[idx[i]], in chunks of
   SPLIT_CHUNK_ROWS rows: every payload of a chunk, then every scale, so that misses and page
   walks in the two blocks do not alternate row by row, and the chunk's out rows (270 KB) are
   still in L2 when their scales arrive. Inlined with constant sizes for the V4.1 row, so
   that the copies and the prefetch loops unroll. */
static inline __attribute__((always_inline)) void copy_split(const job_t *j, int64_t lo, int64_t hi, size_t wb,
                                                             size_t sb) {
    const int64_t *idx = j->idx;
    const char *w = j->src, *s = j->src2;
    const size_t out_rb = wb + sb;
    for (int64_t c = lo; c < hi; c += SPLIT_CHUNK_ROWS) {
        const int64_t e = c + SPLIT_CHUNK_ROWS < hi ? c + SPLIT_CHUNK_ROWS : hi;
        for (int64_t i = c; i < e; i++) { /* payloads; the prefetches run on into the next chunk */
            if (i + SPLIT_TOUCH_AHEAD < hi) __builtin_prefetch(w + (size_t)idx[i + SPLIT_TOUCH_AHEAD] * wb, 0, 3);
            if (i + SPLIT_ROW_AHEAD < hi) { /* the lines after the touched first */
                uintptr_t p = (uintptr_t)w + (size_t)idx[i + SPLIT_ROW_AHEAD] * wb;
                prefetch_lines((p & ~(uintptr_t)63) + 64, p + wb);
            }
            memcpy(j->out + (size_t)i * out_rb, w + (size_t)idx[i] * wb, wb);
        }
        for (int64_t i = c; i < e; i++) { /* scales */
            if (i + SPLIT_SCALES_AHEAD < e) {
                uintptr_t p = (uintptr_t)s + (size_t)idx[i + SPLIT_SCALES_AHEAD] * sb;
                prefetch_lines(p, p + sb);
            }
            memcpy(j->out + (size_t)i * out_rb + wb, s + (size_t)idx[i] * sb, sb);
        }
    }
}

/* Rows into split outputs at positions (copy_rows with j->pos set). From a split table as copy_split
   does (payloads of a chunk, then its scales); from packed rows each row's two parts in turn. */
static inline __attribute__((always_inline)) void copy_to_split(const job_t *j, int64_t lo, int64_t hi, size_t wb,
                                                                size_t sb) {
    const int64_t *idx = j->idx, *pos = j->pos;
    if (j->src2 == NULL) {
        const size_t rb = wb + sb;
        for (int64_t i = lo; i < hi; i++) {
            if (i + PREFETCH_AHEAD < hi) prefetch_row(j->src + (size_t)idx[i + PREFETCH_AHEAD] * rb, rb);
            const char *row = j->src + (size_t)idx[i] * rb;
            memcpy(j->wout + (size_t)pos[i] * wb, row, wb);
            memcpy(j->sout + (size_t)pos[i] * sb, row + wb, sb);
        }
        return;
    }
    const char *w = j->src, *s = j->src2;
    for (int64_t c = lo; c < hi; c += SPLIT_CHUNK_ROWS) {
        const int64_t e = c + SPLIT_CHUNK_ROWS < hi ? c + SPLIT_CHUNK_ROWS : hi;
        for (int64_t i = c; i < e; i++) {
            if (i + SPLIT_TOUCH_AHEAD < hi) __builtin_prefetch(w + (size_t)idx[i + SPLIT_TOUCH_AHEAD] * wb, 0, 3);
            if (i + SPLIT_ROW_AHEAD < hi) {
                uintptr_t p = (uintptr_t)w + (size_t)idx[i + SPLIT_ROW_AHEAD] * wb;
                prefetch_lines((p & ~(uintptr_t)63) + 64, p + wb);
            }
            memcpy(j->wout + (size_t)pos[i] * wb, w + (size_t)idx[i] * wb, wb);
        }
        for (int64_t i = c; i < e; i++) {
            if (i + SPLIT_SCALES_AHEAD < e) {
                uintptr_t p = (uintptr_t)s + (size_t)idx[i + SPLIT_SCALES_AHEAD] * sb;
                prefetch_lines(p, p + sb);
            }
            memcpy(j->sout + (size_t)pos[i] * sb, s + (size_t)idx[i] * sb, sb);
        }
    }
}

static void copy_rows(const job_t *j, int64_t lo, int64_t hi) {
    const int64_t *idx = j->idx;
    const size_t rb = j->row_bytes;
    if (j->pos != NULL) {
        if (rb == 256 && j->row_bytes2 == 8) /* the V4.1 row */
            copy_to_split(j, lo, hi, 256, 8);
        else
            copy_to_split(j, lo, hi, rb, j->row_bytes2);
        return;
    }
    if (j->src2 != NULL) {
        if (rb == 256 && j->row_bytes2 == 8) /* the V4.1 row */
            copy_split(j, lo, hi, 256, 8);
        else
            copy_split(j, lo, hi, rb, j->row_bytes2);
        return;
    }
    for (int64_t i = lo; i < hi; i++) {
        if (i + PREFETCH_AHEAD < hi) prefetch_row(j->src + (size_t)idx[i + PREFETCH_AHEAD] * rb, rb);
        memcpy(j->out + (size_t)i * rb, j->src + (size_t)idx[i] * rb, rb);
    }
}

/* Claim and copy blocks of generation `gen` until none are left. */
static void work(uint32_t gen) {
    for (;;) {
        uint64_t c = atomic_load(&claim);
        if ((uint32_t)(c >> 32) != gen || (int64_t)(c & 0xffffffffu) >= job.nblocks) return;
        if (!atomic_compare_exchange_weak(&claim, &c, c + 1)) continue;
        int64_t b = (int64_t)(c & 0xffffffffu);
        int64_t lo = b * BLOCK_ROWS, hi = lo + BLOCK_ROWS < job.n ? lo + BLOCK_ROWS : job.n;
        copy_rows(&job, lo, hi);
        atomic_fetch_add(&done, 1);
    }
}

static void *worker_main(void *arg) {
    int me = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&generation);
    for (;;) {
        uint32_t g;
        int64_t spin_until = now_ns() + IDLE_SPIN_NS;
        uint32_t seen_nudge = atomic_load(&nudge);
        for (int spins = 0; (g = atomic_load(&generation)) == seen; spins++) {
            uint32_t nn = atomic_load(&nudge);
            if (nn != seen_nudge) {
                seen_nudge = nn;
                spin_until = now_ns() + IDLE_SPIN_NS;
            }
            if (spin_until == 0 || ((spins & 63) == 63 && now_ns() > spin_until)) {
                spin_until = 0;
                futex(&generation, FUTEX_WAIT, seen);
            } else if ((spins & 7) == 7) {
                sched_yield(); /* a thread woken on this core (a client reading its reply) runs first */
            } else {
                cpu_relax();
            }
        }
        seen = g;
        if (me < atomic_load(&workers_wanted)) work(g);
    }
    return NULL;
}

/* Grow the pool to `want` workers (pool_lock held); returns how many exist. */
static int ensure_workers(int want) {
    while (n_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 << 10);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)n_workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        n_workers++;
    }
    return n_workers;
}

static void gather_parallel(const job_t *j, int threads) {
    job = *j;
    job.nblocks = (j->n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int workers = ensure_workers(threads - 1); /* the pool may be larger: another caller asked for more */
    if (workers > threads - 1) workers = threads - 1;
    if (workers > job.nblocks - 1) workers = (int)job.nblocks - 1;
    atomic_store(&done, 0);
    atomic_store(&workers_wanted, workers);
    uint32_t gen = atomic_load(&generation) + 1;
    atomic_store(&claim, (uint64_t)gen << 32);
    atomic_store(&generation, gen); /* publishes job, claim and done (seq_cst) */
    /* Wake every sleeper: FUTEX_WAKE picks whom it wakes, and only workers 0..workers-1 take part. */
    if (workers > 0) futex(&generation, FUTEX_WAKE, n_workers);
    work(gen);
    for (int spins = 0; atomic_load(&done) < job.nblocks; spins++) {
        if (spins < 64)
            cpu_relax();
        else
            sched_yield(); /* a worker holding a block may be waiting for this core */
    }
    /* Close the generation: late workers find no block to claim. */
    atomic_store(&claim, ((uint64_t)gen << 32) | (uint64_t)job.nblocks);
}

#define N_VIEWS 3

/* fork() copies only the calling thread: the child's pool is empty, and the lock may have
   been held by a thread that does not exist there. */
static void reset_pool_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    n_workers = 0;
}

/* A gather is coming: wake sleeping workers now, so that they are spinning when it
   starts (a futex wake-up costs tens of microseconds on a VM, a decode gather ~150). */
static void prime_pool(void) {
    if (n_workers > 0) {
        atomic_fetch_add(&nudge, 1);
        futex(&generation, FUTEX_WAKE, n_workers);
    }
}

static PyObject *prime(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    prime_pool();
    Py_RETURN_NONE;
}

/* The whole gather, without the GIL: every index is checked before any row is copied,
   so on an error `out` is untouched. Returns -1 or the position of the first bad index. */
static int64_t run_gather(job_t *j, int threads) {
    int64_t first_bad = first_out_of_range(j, 0, j->n);
    if (first_bad >= 0) return first_bad;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads > 1 && j->n >= MIN_SPLIT_ROWS && pthread_mutex_trylock(&pool_lock) == 0) {
        gather_parallel(j, threads);
        pthread_mutex_unlock(&pool_lock);
    } else {
        copy_rows(j, 0, j->n);
    }
    return -1;
}

static int64_t gather_rows(const char *src, int64_t rows, size_t row_bytes, const int64_t *idx, int64_t n, char *out,
                           int threads) {
    job_t j = {.src = src, .idx = idx, .out = out, .row_bytes = row_bytes, .n = n, .rows = rows};
    return run_gather(&j, threads);
}

static int64_t gather_split_rows(const char *weights, const char *scales, int64_t rows, size_t weight_bytes,
                                 size_t scale_bytes, const int64_t *idx, int64_t n, char *out, int threads) {
    job_t j = {.src = weights, .src2 = scale_bytes ? scales : NULL, .idx = idx, .out = out, .row_bytes = weight_bytes,
               .row_bytes2 = scale_bytes, .n = n, .rows = rows};
    return run_gather(&j, threads);
}

static int64_t gather_to_split_rows(const char *src, int64_t rows, size_t weight_bytes, size_t scale_bytes,
                                    const int64_t *idx, int64_t n, char *weights_out, char *scales_out,
                                    const int64_t *pos, int threads) {
    job_t j = {.src = src, .idx = idx, .row_bytes = weight_bytes, .row_bytes2 = scale_bytes, .n = n, .rows = rows,
               .pos = pos, .wout = weights_out, .sout = scales_out};
    return run_gather(&j, threads);
}

static int64_t gather_split_to_split_rows(const char *weights, const char *scales, int64_t rows, size_t weight_bytes,
                                          size_t scale_bytes, const int64_t *idx, int64_t n, char *weights_out,
                                          char *scales_out, const int64_t *pos, int threads) {
    job_t j = {.src = weights, .src2 = scales, .idx = idx, .row_bytes = weight_bytes, .row_bytes2 = scale_bytes,
               .n = n, .rows = rows, .pos = pos, .wout = weights_out, .sout = scales_out};
    return run_gather(&j, threads);
}


static PyObject *pool_size(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLong(n_workers);
}

static int bad_index(const int64_t *idx, int64_t first_bad, int64_t rows) {
    PyErr_Format(PyExc_IndexError, "gather: index %lld at position %lld is outside [0, %lld)",
                 (long long)idx[first_bad], (long long)first_bad, (long long)rows);
    return -1;
}

/* Buffers of a gather call: views[0..nsrc) the sources, then the index, then out. */
static int get_index_and_out(PyObject *o_idx, PyObject *o_out, Py_buffer *v, int *nv) {
    if (PyObject_GetBuffer(o_idx, &v[*nv], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    (*nv)++;
    if (v[*nv - 1].itemsize != 8 || v[*nv - 1].len % 8) {
        PyErr_SetString(PyExc_TypeError, "gather: index must be an int64 buffer");
        return -1;
    }
    if (PyObject_GetBuffer(o_out, &v[*nv], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    (*nv)++;
    return 0;
}

static PyObject *gather(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_src, *o_idx, *o_out;
    long long row_bytes;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OLOO|i", &o_src, &row_bytes, &o_idx, &o_out, &threads)) return NULL;
    Py_buffer v[N_VIEWS];
    int nv = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_src, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (get_index_and_out(o_idx, o_out, v, &nv) < 0) goto done;
    if (row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "gather: row_bytes must be positive");
        goto done;
    }
    const int64_t n = v[1].len / 8, rows = v[0].len / row_bytes;
    if (n * row_bytes > v[2].len) {
        PyErr_SetString(PyExc_ValueError, "gather: out needs len(index) * row_bytes bytes");
        goto done;
    }
    const int64_t *idx = v[1].buf;
    int64_t first_bad;
    Py_BEGIN_ALLOW_THREADS
    first_bad = gather_rows(v[0].buf, rows, (size_t)row_bytes, idx, n, v[2].buf, threads);
    Py_END_ALLOW_THREADS
    if (first_bad >= 0 && bad_index(idx, first_bad, rows) < 0) goto done;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int i = 0; i < nv; i++) PyBuffer_Release(&v[i]);
    return result;
}

static PyObject *gather_split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o_w, *o_s, *o_idx, *o_out;
    long long wb, sb;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OLOLOO|i", &o_w, &wb, &o_s, &sb, &o_idx, &o_out, &threads)) return NULL;
    Py_buffer v[N_VIEWS + 1];
    int nv = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_w, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (PyObject_GetBuffer(o_s, &v[nv], PyBUF_C_CONTIGUOUS) < 0) goto done;
    nv++;
    if (get_index_and_out(o_idx, o_out, v, &nv) < 0) goto done;
    if (wb <= 0 || sb < 0) {
        PyErr_SetString(PyExc_ValueError, "gather_split: weight_bytes must be positive, scale_bytes >= 0");
        goto done;
    }
    const int64_t n = v[2].len / 8, rows = v[0].len / wb;
    if (rows * sb > v[1].len) {
        PyErr_SetString(PyExc_ValueError, "gather_split: scales hold fewer rows than weights");
        goto done;
    }
    if (n * (wb + sb) > v[3].len) {
        PyErr_SetString(PyExc_ValueError, "gather_split: out needs len(index) * (weight_bytes + scale_bytes) bytes");
        goto done;
    }
    const int64_t *idx = v[2].buf;
    int64_t first_bad;
    Py_BEGIN_ALLOW_THREADS
    first_bad = gather_split_rows(v[0].buf, v[1].buf, rows, (size_t)wb, (size_t)sb, idx, n, v[3].buf, threads);
    Py_END_ALLOW_THREADS
    if (first_bad >= 0 && bad_index(idx, first_bad, rows) < 0) goto done;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int i = 0; i < nv; i++) PyBuffer_Release(&v[i]);
    return result;
}

#include "gather_staging.h" /* gather_to_split, gather_split_to_split, gate_claim, gate_done for Python */

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

static engram_gather_api c_api = {.gather = gather_rows, .prime = prime_pool, .gather_split = gather_split_rows,
                                  .take_int32 = take_i32, .bump_counts = bump_counts,
                                  .guard_type = &EpochGuardType, .guard_lock = guard_lock, .guard_unlock = guard_unlock,
                                  .guard_enter = guard_enter, .guard_leave = guard_leave,
                                  .gather_to_split = gather_to_split_rows,
                                  .gather_split_to_split = gather_split_to_split_rows};

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
     "gate_claim(buffer, offset, request_id) -> bool: a staging gate OPEN(request) -> WRITING (staging_gate.h)"},
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
    pthread_atfork(NULL, NULL, reset_pool_in_child);
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
