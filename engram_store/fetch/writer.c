/* The fetch job's writer: see writer.h. */
#include "writer.h"

#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

#include "staging_gate.h"
#include "test_hooks.h"



int hung_up(int sock) {
    struct pollfd p = {.fd = sock, .events = 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR));
}

int peer_pidfd(int fd) {
    if (test_hook_on(TEST_HOOK_WITHOUT_PIDFDS)) return -1;
    int pidfd = -1;
    socklen_t len = sizeof pidfd;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0) {
        fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        return pidfd;
    }
    struct ucred cred;
    len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return -1;
    const long opened = syscall(SYS_pidfd_open, cred.pid, 0);
    if (opened < 0) return -1;
    fcntl((int)opened, F_SETFD, FD_CLOEXEC);
    return (int)opened;
}

void writer_release(writer_t *w) {
    if (w->pidfd >= 0) close(w->pidfd);
    if (w->sock >= 0) close(w->sock);
    *w = (writer_t){.pidfd = -1, .sock = -1};
}

writer_t writer_of(core_t *c) {
    writer_t w = {.pidfd = -1, .sock = -1};
    if (c->peer_pidfd >= 0) w.pidfd = fcntl(c->peer_pidfd, F_DUPFD_CLOEXEC, 0);
    if (w.pidfd >= 0) return w;
    if (c->sock >= 0) w.sock = fcntl(c->sock, F_DUPFD_CLOEXEC, 0);
    else w.hup_ns = c->peer_hup_ns;
    return w;
}

/* Whether the writer has stopped for good (never waits). */
static int writer_gone(writer_t *w, int64_t now) {
    if (w->pidfd >= 0) {
        struct pollfd p = {.fd = w->pidfd, .events = POLLIN};
        return poll(&p, 1, 0) > 0;
    }
    if (!w->hup_ns && w->sock >= 0 && hung_up(w->sock)) w->hup_ns = now;
    return w->hup_ns && now - w->hup_ns >= WRITER_HANGUP_GRACE_NS;
}

int writer_wait(core_t *c, writer_t *w, int64_t until) {
    uint32_t *g = c->gate;
    for (;;) {
        uint32_t word = __atomic_load_n(g, __ATOMIC_ACQUIRE);
        if (GATE_STATE(word) != GATE_WRITING) return 1;
        const int64_t now = now_ns();
        if (writer_gone(w, now)) {
            if (__atomic_compare_exchange_n(g, &word, (word & ~3u) | GATE_REVOKED, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
                atomic_fetch_add(&c->dead_writers, 1);
            continue;
        }
        int64_t left = until - now;
        if (left <= 0) return 0;
        if (left > 1000000) left = 1000000; /* look at the writer every millisecond */
        const struct timespec ts = {.tv_sec = 0, .tv_nsec = left};
        syscall(SYS_futex, g, FUTEX_WAIT, word, &ts, NULL, 0);
    }
}

int64_t writer_grace_end(writer_t *w, int64_t now, int64_t limit) {
    writer_gone(w, now);
    if (w->pidfd >= 0 || !w->hup_ns) return now;
    const int64_t end = w->hup_ns + WRITER_HANGUP_GRACE_NS;
    return end < limit ? end : limit;
}
