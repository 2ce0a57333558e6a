/* The staging gate's transitions (staging_gate.h). */
#include "staging_gate.h"

#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static uint32_t gate_word(uint64_t rid, uint32_t state) {
    return (uint32_t)((rid & 0x3fffffffu) << 2) | state;
}

/* daemon: 1 when this request's rows may be written now (and no client can revoke it any more) */
int gate_claim(uint32_t *g, uint64_t rid) {
    uint32_t want = gate_word(rid, GATE_OPEN);
    return __atomic_compare_exchange_n(g, &want, gate_word(rid, GATE_WRITING), 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

/* daemon: the last row is written (after a successful gate_claim) */
void gate_done(uint32_t *g, uint64_t rid) {
    uint32_t want = gate_word(rid, GATE_WRITING);
    if (__atomic_compare_exchange_n(g, &want, gate_word(rid, GATE_DONE), 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        syscall(SYS_futex, g, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* client */
void gate_open(uint32_t *g, uint64_t rid) {
    __atomic_store_n(g, gate_word(rid, GATE_OPEN), __ATOMIC_RELEASE);
}

int gate_is_done(uint32_t *g, uint64_t rid) {
    return __atomic_load_n(g, __ATOMIC_ACQUIRE) == gate_word(rid, GATE_DONE);
}

/* client: no daemon may write from now on, unless one is writing already: returns GATE_WRITING then
   (wait with gate_wait), else GATE_REVOKED (revoked now) or GATE_DONE (that request's rows are all in). */
uint32_t gate_revoke(uint32_t *g) {
    uint32_t w = __atomic_load_n(g, __ATOMIC_ACQUIRE);
    for (;;) {
        if (GATE_STATE(w) != GATE_OPEN) return GATE_STATE(w) == GATE_WRITING ? GATE_WRITING :
                                               GATE_STATE(w) == GATE_DONE ? GATE_DONE : GATE_REVOKED;
        if (__atomic_compare_exchange_n(g, &w, (w & ~3u) | GATE_REVOKED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return GATE_REVOKED;
    }
}

static int64_t gate_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whether the process behind pidfd has exited (its writes have ended with it); 0 when unknown. */
int gate_writer_gone(int pidfd) {
    if (pidfd < 0) return 0;
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

/* client: wait until the word is not WRITING: 1 (then no write is in progress: a writer that exited
   is revoked here), or 0 when it still is at `deadline` (CLOCK_MONOTONIC ns). */
int gate_wait(uint32_t *g, int64_t deadline, int pidfd) {
    for (;;) {
        uint32_t w = __atomic_load_n(g, __ATOMIC_ACQUIRE);
        if (GATE_STATE(w) != GATE_WRITING) return 1;
        if (gate_writer_gone(pidfd)) {
            __atomic_compare_exchange_n(g, &w, (w & ~3u) | GATE_REVOKED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
            continue;
        }
        int64_t left = deadline - gate_now_ns();
        if (left <= 0) return 0;
        if (left > 1000000) left = 1000000; /* look at the writer's process every millisecond */
        const struct timespec ts = {.tv_sec = 0, .tv_nsec = left};
        syscall(SYS_futex, g, FUTEX_WAIT, w, &ts, NULL, 0);
    }
}
