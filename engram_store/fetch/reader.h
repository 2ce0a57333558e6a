/* The fetch job's direct reads (fetch/_fetch.c): one reader thread per job reads the rows' 4 KiB
 * pages from the table files, checks each against its crc32c (in private memory) before any row
 * of it is used, and packs the rows, in its own buffers. The run function hands it a request and
 * waits for it with a deadline (polling efd): a stuck device holds the reader, never the run.
 *
 *   reader_submit(c, m, &gen)   hand over the run's taken rows (their ids copied): 1 handed over;
 *                               0 busy with a request a run gave up on (its end is counted on efd);
 *                               -1 unavailable (stuck past a deadline, or no thread); -2 the node's
 *                               budget of direct pages in flight is spent (direct_budget.h; the read
 *                               runs at the depth the budget gives, its granules given back at its end)
 *   reader_poll(c, gen)         after efd fired: 1 when request gen is done (its result is the run's)
 *   reader_abandon(c, stuck)    the run gives up on its request: the reader stops submitting, and
 *                               its result is dropped; stuck: later requests are refused at once
 *                               until it ends
 *
 * Before and after each request the files are re-checked (watched_t): a file changed, replaced or
 * removed since the job opened it ends the request with `changed` set, no row used.
 * The test hook hold_reads (common/test_hooks.h) holds every reader before its next request: the
 * tests' stuck device.
 */
#ifndef ENGRAM_STORE_FETCH_READER_H
#define ENGRAM_STORE_FETCH_READER_H

#include <stdint.h>

#include "core.h"

#define KEY_ROW_BITS 22   /* sort keys: stripe (6 bits, MAX_STRIPES) | page in the stripe | k < 2^22 rows a run */
#define KEY_PAGE_BITS 36
#define KEY_STRIPE(key) ((int64_t)((key) >> (KEY_PAGE_BITS + KEY_ROW_BITS)))
#define KEY_K(key) ((int64_t)((key) & (((uint64_t)1 << KEY_ROW_BITS) - 1)))

void crc_blob_release(crc_blob *b);
int reader_submit(core_t *c, int64_t m, uint64_t *gen);
int reader_poll(core_t *c, uint64_t gen);
void reader_abandon(core_t *c, int stuck);
/* Whether a request handed over now would start at once (the reader is not on an earlier one). */
int reader_idle(core_t *c);
/* Seconds the reader has been on its current request, or 0 when it is not stuck. */
double reader_stuck_seconds(core_t *c);
/* The Job is closing: an idle reader ends now, a busy one after its request (its result dropped). */
void reader_quit(core_t *c);
/* 0, or -1 (memory). release: how the thread gives its reference to the core back when it ends
   (lifecycle.h's core_release, handed down: this unit calls nothing above it). */
int reader_init(core_t *c, int qd, void (*release)(core_t *c));
/* With the last reference: the files, buffers and checksums go (the thread has ended). */
void reader_free(core_t *c);

#endif
