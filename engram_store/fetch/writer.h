/* Whether the daemon writing a step's rows into the staging has stopped for good (fetch/_fetch.c).
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
 *   hung_up(sock)             whether the other end of a connection hung up (daemon.c notes it when it drops one)
 *
 * The job keeps the watch of a write still in progress at a deadline (gate_stuck, run.h) for as
 * long as it lasts; a connection it dropped meanwhile stays open through the watch's dup, so its
 * hangup is still seen. The test hook without_pidfds (common/test_hooks.h) makes the job open no pidfd: the
 * connection's way, as on an older kernel across PID namespaces.
 */
#ifndef ENGRAM_STORE_FETCH_WRITER_H
#define ENGRAM_STORE_FETCH_WRITER_H

#include <stdint.h>

#include "core.h"

#define WRITER_HANGUP_GRACE_NS 200000000LL /* 200 ms after the daemon's end of the connection hung up */

/* Whether the daemon's end of a connection hung up (both directions shut, or reset). */
int hung_up(int sock);
/* A pidfd of the process at the other end of a Unix socket, or -1 (unknown). */
int peer_pidfd(int fd);
void writer_release(writer_t *w);
/* The writer of the request sent on c's connection: its pidfd, else the connection (or, when the step
   dropped the connection, when it saw it hang up). */
writer_t writer_of(core_t *c);
int writer_wait(core_t *c, writer_t *w, int64_t until);
/* When a wait for a stuck write that has hung up may end: its grace, at most `limit`; else now. */
int64_t writer_grace_end(writer_t *w, int64_t now, int64_t limit);

#endif
