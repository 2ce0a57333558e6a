/* The fetch job's exchange with the daemon (fetch/_fetch.c): one LOOKUP at a time on the job's
 * connection, the rows written by the daemon into the connection's shared region.
 *
 *   daemon_usable(c, now, backoff)  whether this step may ask the daemon: connected, no earlier request
 *                             still unanswered (its late answer is read and dropped here, matched by
 *                             request id; unanswered a deadline after it was sent: the connection is
 *                             dropped), not backing off
 *   send_request(c, m, n)     the taken rows' ids into the region, one LOOKUP; 0 or -1 (dropped). With
 *                             the staging taken by the daemon (c->split) all n ids go, PAD_ID where a
 *                             row is not taken, in one LOOKUP with FLAG_SPLIT, the gate opened first:
 *                             the daemon writes the rows into the staging itself (one host copy)
 *   read_answer(c, deadline)  the RESULT: 1 rows in the region; 0 the daemon answered an error;
 *                             -1 the transport failed (dropped)
 *   hedge_budget(c)           how long a step waits for the daemon before it also reads directly
 *   daemon_answered / daemon_slow   the measured latency and the back-off (below)
 *
 * The hedge budget: HEDGE_FLOOR + HEDGE_MULT x the p99 of the last LAT_RING answers (2 ms + 2 x
 * p99), at most HEDGE_CAP or a quarter of the deadline; the cap until HEDGE_WARMUP answers are
 * measured. The back-off: after BACKOFF_STREAK consecutive requests unanswered within their budget,
 * steps skip the daemon for backoff_ns (50 ms, doubling at each new streak up to BACKOFF_MAX), unless
 * the reader is still on an earlier request; an answer within budget resets both.
 */
#ifndef ENGRAM_STORE_FETCH_DAEMON_H
#define ENGRAM_STORE_FETCH_DAEMON_H

#include <stdint.h>

#include "core.h"

#define HEDGE_FLOOR_NS 2000000LL
#define HEDGE_MULT 2
#define HEDGE_CAP_NS 100000000LL
#define HEDGE_WARMUP 16
#define BACKOFF_STREAK 3
#define BACKOFF_MIN_NS 50000000LL
#define BACKOFF_MAX_NS 2000000000LL
#define LATE_FRAME_NS 10000000LL  /* a late answer found readable between steps: the rest of its frame */

/* Drop the connection (closed; `why` becomes the note); connected is false until attach(). */
void daemon_drop(core_t *c, const char *why);
/* An earlier step's request is unanswered: read its answer if it came (and drop it), else tell. */
int settle_pending(core_t *c, int64_t now);
/* backoff: whether a back-off may skip the daemon (not when the node's direct-read budget is spent: then
   waiting for the daemon is the way to be served) */
int daemon_usable(core_t *c, int64_t now, int backoff);
int send_request(core_t *c, int64_t m, int64_t n);
int read_answer(core_t *c, int64_t deadline);
int64_t hedge_budget(core_t *c);
/* The daemon answered this step after latency_ns; within its budget or not. */
void daemon_answered(core_t *c, int64_t latency_ns, int in_budget);
/* A request of this step went unanswered within its budget. */
void daemon_slow(core_t *c, int64_t now);

#endif
