/* The fetch job's direct budget: see direct_budget.h. */
#include "direct_budget.h"

#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>



static int budget_lock(int fd, int64_t g, short type) {
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = BUDGET_LOCKS + g, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &l);
}

int budget_map(core_t *c, int fd) {
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

void budget_unmap(core_t *c) {
    if (c->budget) munmap(c->budget, BUDGET_FILE_BYTES);
    if (c->budget_fd >= 0) close(c->budget_fd);
    c->budget = NULL;
    c->budget_fd = -1;
}

static int64_t *budget_i64(core_t *c, int at) { return (int64_t *)(c->budget + at); }

int64_t budget_take(core_t *c, int64_t pages, int32_t *held, int *nheld) {
    *nheld = 0;
    uint32_t granules = __atomic_load_n((uint32_t *)(c->budget + BUDGET_GRANULES_AT), __ATOMIC_RELAXED);
    const uint32_t per = *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
    if (granules > BUDGET_MAX_GRANULES) granules = BUDGET_MAX_GRANULES;
    int64_t want = (pages + per - 1) / per;
    if (want > AIO_MAX_QD) want = AIO_MAX_QD;
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

int64_t budget_pages(core_t *c) {
    if (!c->budget) return 0;
    return (int64_t)__atomic_load_n((uint32_t *)(c->budget + BUDGET_GRANULES_AT), __ATOMIC_RELAXED) *
           *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
}

int budget_room(core_t *c) {
    return !c->budget || __atomic_load_n(budget_i64(c, BUDGET_RESERVED_AT), __ATOMIC_RELAXED) < budget_pages(c);
}

void budget_give(core_t *c, const int32_t *held, int nheld) {
    if (nheld <= 0) return;
    const uint32_t per = *(uint32_t *)(c->budget + BUDGET_GRANULE_AT);
    for (int i = 0; i < nheld; i++) {  /* unmarked, uncounted, then let go */
        __atomic_store_n(c->budget + BUDGET_HELD_AT + held[i], 0, __ATOMIC_RELAXED);
        __atomic_fetch_sub(budget_i64(c, BUDGET_RESERVED_AT), (int64_t)per, __ATOMIC_RELAXED);
        budget_lock(c->budget_fd, held[i], F_UNLCK);
    }
}
