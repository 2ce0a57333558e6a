/* The gather core (pool.h): every source x destination layout of gather_job_t (gather_api.h) copied
 * by one set of loops, on the caller's thread or split across a small pool of native threads.
 *
 * Rows are copied in blocks of BLOCK_ROWS; up to `threads` threads (the caller plus pool workers)
 * claim blocks from a shared counter, so a worker that the scheduler delays simply takes fewer
 * blocks. Each thread software-prefetches rows a few indices ahead so that cache and TLB misses
 * overlap: a random gather over a large table is bound by memory latency, not bandwidth.
 *
 * The pool is created on first use and grows to the largest `threads` asked for (at most
 * MAX_WORKERS + 1). It serves one gather at a time: a caller that finds it busy copies on its own
 * thread instead of waiting. Idle workers spin for a few microseconds after a job (back-to-back
 * requests then start at once) and sleep on a futex after that, so an idle pool costs no CPU;
 * gather_prime() wakes them ahead of a gather that is about to come. A child process after fork()
 * starts with no workers and grows its own pool.
 *
 * Why not the Python thread pool: a hand-off through it costs tens of microseconds of GIL and
 * condition-variable traffic per part, which is the whole budget of a decode-sized gather.
 */
#include "pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BLOCK_ROWS 1024     /* rows per claim: small enough to balance, large enough to amortize */
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

/* The one job in flight. `claim` packs (generation << 32 | next block); a worker
 * may take a block only while the generation is the one it woke for, so a late
 * worker never touches a finished job. `done` counts finished blocks. */
static gather_job_t job;
static int64_t nblocks; /* of the job in flight */
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
static int64_t first_out_of_range(const gather_job_t *j, int64_t lo, int64_t hi) {
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
static inline __attribute__((always_inline)) void copy_split(const gather_job_t *j, int64_t lo, int64_t hi, size_t wb,
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
static inline __attribute__((always_inline)) void copy_to_split(const gather_job_t *j, int64_t lo, int64_t hi, size_t wb,
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

static void copy_rows(const gather_job_t *j, int64_t lo, int64_t hi) {
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
        if ((uint32_t)(c >> 32) != gen || (int64_t)(c & 0xffffffffu) >= nblocks) return;
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

static void gather_parallel(const gather_job_t *j, int threads) {
    job = *j;
    nblocks = (j->n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int workers = ensure_workers(threads - 1); /* the pool may be larger: another caller asked for more */
    if (workers > threads - 1) workers = threads - 1;
    if (workers > nblocks - 1) workers = (int)nblocks - 1;
    atomic_store(&done, 0);
    atomic_store(&workers_wanted, workers);
    uint32_t gen = atomic_load(&generation) + 1;
    atomic_store(&claim, (uint64_t)gen << 32);
    atomic_store(&generation, gen); /* publishes job, claim and done (seq_cst) */
    /* Wake every sleeper: FUTEX_WAKE picks whom it wakes, and only workers 0..workers-1 take part. */
    if (workers > 0) futex(&generation, FUTEX_WAKE, n_workers);
    work(gen);
    for (int spins = 0; atomic_load(&done) < nblocks; spins++) {
        if (spins < 64)
            cpu_relax();
        else
            sched_yield(); /* a worker holding a block may be waiting for this core */
    }
    /* Close the generation: late workers find no block to claim. */
    atomic_store(&claim, ((uint64_t)gen << 32) | (uint64_t)nblocks);
}

/* fork() copies only the calling thread: the child's pool is empty, and the lock may have
   been held by a thread that does not exist there. */
static void reset_pool_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    n_workers = 0;
}

/* A gather is coming: wake sleeping workers now, so that they are spinning when it
   starts (a futex wake-up costs tens of microseconds on a VM, a decode gather ~150). */
void gather_prime(void) {
    if (n_workers > 0) {
        atomic_fetch_add(&nudge, 1);
        futex(&generation, FUTEX_WAKE, n_workers);
    }
}

int64_t gather_run(const gather_job_t *j, int threads) {
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

int gather_pool_size(void) { return n_workers; }

void gather_pool_init(void) { pthread_atfork(NULL, NULL, reset_pool_in_child); }
