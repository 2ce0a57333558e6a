/* The gate of a client's staging (engram_store/wire/staging.py): a 32-bit word in the staging memfd,
 * shared by the client (fetch/_fetch.c) and the daemon (daemon/_unixfast.c, and the Python path
 * through native/gather/_gather.c), that says whether the daemon may write request R's rows:
 *
 *   word = (R mod 2^30) << 2 | state      REVOKED 0, OPEN 1, WRITING 2, DONE 3
 *
 *   client  gate_open(g, R)      before sending R
 *   daemon  gate_claim(g, R)     right before its first write: OPEN(R) -> WRITING(R), else no write
 *   daemon  gate_done(g, R)      after its last write: WRITING(R) -> DONE(R), futex wake; then RESULT
 *   client  gate_revoke(g, R)    giving up on R: OPEN -> REVOKED; tells when the daemon is writing
 *   client  gate_wait(g, ...)    until the word leaves WRITING, the writer's process exits (pidfd)
 *                                or the deadline passes
 *
 * The futex is a shared one (no FUTEX_PRIVATE_FLAG): the two processes map the same memfd page.
 */
#ifndef ENGRAM_STORE_STAGING_GATE_H
#define ENGRAM_STORE_STAGING_GATE_H

#include <stdint.h>

enum { GATE_REVOKED = 0, GATE_OPEN = 1, GATE_WRITING = 2, GATE_DONE = 3 };
#define GATE_STATE(w) ((w) & 3u)

/* daemon: 1 when this request's rows may be written now (and no client can revoke it any more) */
int gate_claim(uint32_t *g, uint64_t rid);
/* daemon: the last row is written (after a successful gate_claim) */
void gate_done(uint32_t *g, uint64_t rid);
/* client: R may be written */
void gate_open(uint32_t *g, uint64_t rid);
/* client: R's rows are all in */
int gate_is_done(uint32_t *g, uint64_t rid);
/* client: no daemon may write from now on, unless one is writing already: returns GATE_WRITING then
   (wait with gate_wait), else GATE_REVOKED (revoked now) or GATE_DONE (that request's rows are all in). */
uint32_t gate_revoke(uint32_t *g);
/* Whether the process behind pidfd has exited (its writes have ended with it); 0 when unknown. */
int gate_writer_gone(int pidfd);
/* client: wait until the word is not WRITING: 1 (then no write is in progress: a writer that exited
   is revoked here), or 0 when it still is at `deadline` (CLOCK_MONOTONIC ns). */
int gate_wait(uint32_t *g, int64_t deadline, int pidfd);

#endif
