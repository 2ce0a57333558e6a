/* What the native path's units share (unixfast_io.h): the gather pool's API, the fair share, the clock,
 * the socket send, a connection's staging given up. A unit of _unixfast, below _unixfast.c and
 * staging_serve.c. */
#include "unixfast_io.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_YIELD_NS 2000000LL  /* the longest one piece waits for small lookups to finish */

const engram_gather_api *gather_api;

/* The fair share of every Conn of this process. */
_Atomic uint32_t small_active;         /* small lookups gathering now (a futex word) */
static _Atomic uint32_t large_waiting; /* pieces asleep on small_active */
_Atomic uint64_t pieces_served;
_Atomic uint64_t pieces_yielded;

int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static long futex_wait(_Atomic uint32_t *addr, uint32_t val, int64_t timeout_ns) {
    struct timespec ts = {.tv_sec = timeout_ns / 1000000000, .tv_nsec = timeout_ns % 1000000000};
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT | FUTEX_PRIVATE_FLAG, val, timeout_ns > 0 ? &ts : NULL,
                   NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
}

/* Before a piece: let small lookups in progress finish first, MAX_YIELD_NS at most. */
void yield_to_small(void) {
    const int64_t deadline = now_ns() + MAX_YIELD_NS;
    int waited = 0;
    for (uint32_t s; (s = atomic_load(&small_active)) != 0;) {
        const int64_t left = deadline - now_ns();
        if (left <= 0) break;
        atomic_fetch_add(&large_waiting, 1);
        futex_wait(&small_active, s, left);
        atomic_fetch_sub(&large_waiting, 1);
        waited = 1;
    }
    pieces_yielded += waited;
}

void small_done(void) {
    if (atomic_fetch_sub(&small_active, 1) == 1 && atomic_load(&large_waiting)) futex_wake_all(&small_active);
}

/* fork() copies only the calling thread: small lookups of threads that do not exist there are void. */
void reset_fair_share_in_child(void) {
    small_active = large_waiting = 0;
}

void release_staging(Conn *c) {
    if (!c->has_staging) return;
    c->has_staging = 0;
    PyBuffer_Release(&c->st_weights);
    PyBuffer_Release(&c->st_scales);
    PyBuffer_Release(&c->st_gate);
    PyMem_Free(c->pos);
    c->pos = NULL;
}

int send_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len) {
        ssize_t r = send(fd, p, len, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += r;
        len -= (size_t)r;
    }
    return 0;
}
