/* Whether the daemon writing a step's rows into the staging has stopped for good (native/_fetch.c).
 * A step that gives up on a one-copy request may find the daemon mid-write (its gate WRITING,
 * staging_gate.h); no row of the step's own may go in until that write ends: the gate leaves WRITING,
 * or the writer is gone, its writes with it. The writer's end is seen one of two ways:
 *
 *   its process    a pidfd of the daemon (POLLIN once it exited): from SO_PEERPIDFD where the kernel
 *                  has it (Linux >= 6.5; it crosses PID namespaces, as between pods without hostPID),
 *                  else pidfd_open of SO_PEERCRED's pid (the same PID namespace only: across namespaces
 *                  the kernel names no pid);
 *   its connection without a pidfd: the daemon's end of the job's connection hung up (both directions
 *                  shut: POLLHUP) and the gate has stayed WRITING for WRITER_HANGUP_GRACE_NS since it
 *                  was first seen. A process's sockets close only after every thread of it has left
 *                  user mode (exit_mm comes before exit_files), so a daemon killed mid-write hangs up
 *                  with its write over for good. A live daemon shuts a connection down while one of its
 *                  writes is in progress only when it drops the client (its drain running out as it
 *                  stops, an idle drop of a lookup running for minutes); the grace is for the rest of
 *                  that write. (A daemon that stalls longer than the grace after such a shutdown would
 *                  be taken for gone: the daemon should end a connection's gate before shutting it.)
 *
 *   writer_of(c)              the watch of the write of c's current connection (dups: the watch's own)
 *   writer_wait(c, w, until)  until the gate leaves WRITING (1; a gone writer's gate is revoked here,
 *                             counted in dead_writers) or `until` (0)
 *   writer_release(w)
 *
 * The job keeps the watch of a write still in progress at a deadline (gate_stuck, fetch_run.h) for as
 * long as it lasts; a connection it dropped meanwhile stays open through the watch's dup, so its
 * hangup is still seen. test_without_pidfds (module function) makes the job open no pidfd: the
 * connection's way, as on an older kernel across PID namespaces.
 * Include after fetch_core.h, staging_gate.h and fetch_daemon.h (hung_up).
 */
#ifndef ENGRAM_STORE_FETCH_WRITER_H
#define ENGRAM_STORE_FETCH_WRITER_H

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

#define WRITER_HANGUP_GRACE_NS 200000000LL /* 200 ms after the daemon's end of the connection hung up */

static _Atomic int no_pidfds; /* test_without_pidfds */

/* A pidfd of the process at the other end of a Unix socket, or -1 (unknown). */
static int peer_pidfd(int fd) {
    if (atomic_load(&no_pidfds)) return -1;
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

static void writer_release(writer_t *w) {
    if (w->pidfd >= 0) close(w->pidfd);
    if (w->sock >= 0) close(w->sock);
    *w = (writer_t){.pidfd = -1, .sock = -1};
}

/* The writer of the request sent on c's connection: its pidfd, else the connection (or, when the step
   dropped the connection, when it saw it hang up). */
static writer_t writer_of(core_t *c) {
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

static int writer_wait(core_t *c, writer_t *w, int64_t until) {
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

/* When a wait for a stuck write that has hung up may end: its grace, at most `limit`; else now. */
static int64_t writer_grace_end(writer_t *w, int64_t now, int64_t limit) {
    writer_gone(w, now);
    if (w->pidfd >= 0 || !w->hup_ns) return now;
    const int64_t end = w->hup_ns + WRITER_HANGUP_GRACE_NS;
    return end < limit ? end : limit;
}

#endif
