/* The node's budget of direct page reads in flight (native/_fetch.c), shared by every fetch job on the
 * node that reads the same device: hedged and fallback direct reads of all of them stay within it, so a
 * slow daemon (usually a busy disk) is not answered by every job reading the same disk at once.
 *
 * The budget is a small file (engram_store/client/direct_budget.py makes and sizes it: the device's
 * queue depth from sysfs, or ENGRAM_STORE_DIRECT_BUDGET_PAGES): a header page, and `granules` granules
 * of `granule_pages` pages each. A job holds a granule while it holds an OFD lock (F_OFD_SETLK) on byte
 * BUDGET_LOCKS + g of the file, through an open file description of its own: the kernel drops the locks
 * of a process that dies, so a crashed engine never keeps any of the budget. A direct read of a job
 * takes what it may use (its queue depth, at most the request's pages) in granules, at least one, and
 * reads at the depth it got; with none free it gets none (the run then waits for the daemon, or for the
 * budget, to its deadline: fetch_run.h). The reader gives the granules back when its read ends (a read
 * the run gave up on keeps them until then: its pages are still in flight).
 *
 * The header's counters (pages reserved now, the most reserved at once, refusals) are for metrics
 * and the benchmark only: the locks are the budget. Each granule has a mark in the second page (set by
 * its holder, cleared before it lets go), so a granule whose holder died holding it (a process exits
 * with a read in flight) stays counted once, not twice, until the next holder takes it over. Its layout is engram_store/client/direct_budget.py's LAYOUT, which Python checks
 * against BUDGET_OFFSETS (the module's constant) before it hands a budget over.
 *
 *   budget_take(c, pages, held, &n)   granules for a read of `pages` pages in flight at most: the pages
 *                                      it may read at once (n granules in held), 0 none free
 *   budget_give(c, held, n)
 */
#ifndef ENGRAM_STORE_FETCH_BUDGET_H
#define ENGRAM_STORE_FETCH_BUDGET_H

#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define BUDGET_MAGIC 0x54474442u /* "BDGT" */
#define BUDGET_VERSION 2
#define BUDGET_HEADER_BYTES 4096
#define BUDGET_FILE_BYTES 8192
#define BUDGET_MAGIC_AT 0      /* u32 */
#define BUDGET_VERSION_AT 4    /* u32 */
#define BUDGET_GRANULES_AT 8   /* u32: granules in the budget now (the last sizing wins) */
#define BUDGET_GRANULE_AT 12   /* u32: pages a granule */
#define BUDGET_RESERVED_AT 16  /* i64: pages reserved now, all jobs */
#define BUDGET_MAX_AT 24       /* i64: the most pages reserved at once */
#define BUDGET_REFUSED_AT 32   /* i64: direct reads refused (none free) */
#define BUDGET_LOCKS 4096      /* granule g: an OFD lock on byte BUDGET_LOCKS + g */
#define BUDGET_HELD_AT 4096    /* u8[BUDGET_MAX_GRANULES]: granule g counted in `reserved` (its holder's mark) */
#define BUDGET_MAX_GRANULES 4096

static int budget_lock(int fd, int64_t g, short type) {
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = BUDGET_LOCKS + g, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &l);
}

/* 0, or -1 when fd is not a budget file (errno set). */
static int budget_map(core_t *c, int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < BUDGET_FILE_BYTES) {
        errno = EINVAL;
        return -1;
    }
    void *p = mmap(NULL, BUDGET_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return -1;
    const uint32_t *h = p;
    if (h[0] != BUDGET_MAGIC || h[1] != BUDGET_VERSION || h[3] == 0) {
        munmap(p, BUDGET_FILE_BYTES);
        errno = EINVAL;
        return -1;
    }
    c->budget_fd = fd;
    c->budget = p;
    return 0;
}

static void budget_unmap(core_t *c) {
    if (c->budget) munmap(c->budget, BUDGET_FILE_BYTES);
    if (c->budget_fd >= 0) close(c->budget_fd);
    c->budget = NULL;
    c->budget_fd = -1;
}

static int64_t *budget_i64(core_t *c, int at) { return (int64_t *)(c->budget + at); }

static int64_t budget_take(core_t *c, int64_t pages, int32_t *held, int *nheld) {
    *nheld = 0;
    uint32_t granules = __atomic_load_n((uint32_t *)(c->budget + BUDGET_GRANULES_AT), __ATOMIC_RELAXED);
    const uint32_t per = *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
    if (granules > BUDGET_MAX_GRANULES) granules = BUDGET_MAX_GRANULES;
    int64_t want = (pages + per - 1) / per;
    if (want > MAX_QD) want = MAX_QD;
    int64_t counted = 0;  /* granules newly counted in `reserved` (one a holder that died left counted is not) */
    for (uint32_t i = 0; i < granules && *nheld < want; i++) {
        const uint32_t g = (c->budget_next + i) % granules;  /* jobs start apart: fewer locks tried */
        if (budget_lock(c->budget_fd, g, F_WRLCK) != 0) continue;
        held[(*nheld)++] = (int32_t)g;
        counted += !__atomic_exchange_n(c->budget + BUDGET_HELD_AT + g, 1, __ATOMIC_RELAXED);
    }
    c->budget_next = granules ? (c->budget_next + (uint32_t)*nheld) % granules : 0;
    if (*nheld == 0) {
        __atomic_fetch_add(budget_i64(c, BUDGET_REFUSED_AT), 1, __ATOMIC_RELAXED);
        return 0;
    }
    const int64_t got = (int64_t)*nheld * per;
    const int64_t now = __atomic_add_fetch(budget_i64(c, BUDGET_RESERVED_AT), counted * per, __ATOMIC_RELAXED);
    int64_t *mx = budget_i64(c, BUDGET_MAX_AT);
    for (int64_t m = __atomic_load_n(mx, __ATOMIC_RELAXED);
         now > m && !__atomic_compare_exchange_n(mx, &m, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED);) {
    }
    return got < pages ? got : pages;
}

/* The budget's pages now, 0 without one. */
static int64_t budget_pages(core_t *c) {
    if (!c->budget) return 0;
    return (int64_t)__atomic_load_n((uint32_t *)(c->budget + BUDGET_GRANULES_AT), __ATOMIC_RELAXED) *
           *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
}

/* Whether some of the budget looks free (the counters: a hint, never the budget itself); 1 without one. */
static int budget_room(core_t *c) {
    return !c->budget || __atomic_load_n(budget_i64(c, BUDGET_RESERVED_AT), __ATOMIC_RELAXED) < budget_pages(c);
}

static void budget_give(core_t *c, const int32_t *held, int nheld) {
    if (nheld <= 0) return;
    const uint32_t per = *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
    for (int i = 0; i < nheld; i++) {  /* unmarked, uncounted, then let go */
        __atomic_store_n(c->budget + BUDGET_HELD_AT + held[i], 0, __ATOMIC_RELAXED);
        __atomic_fetch_sub(budget_i64(c, BUDGET_RESERVED_AT), (int64_t)per, __ATOMIC_RELAXED);
        budget_lock(c->budget_fd, held[i], F_UNLCK);
    }
}

#endif
