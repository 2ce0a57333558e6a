/* The fetch job's core from its last users' side (fetch/_fetch.c): its close, and the references that
 * free it (core.h's lifetime rules). Above the units whose parts it frees (reader.h, writer.h,
 * direct_budget.h); the reader thread gives its reference back through the release function it was
 * handed (reader_init), never by calling up here.
 */
#ifndef ENGRAM_STORE_FETCH_LIFECYCLE_H
#define ENGRAM_STORE_FETCH_LIFECYCLE_H

#include "core.h"

/* One reference fewer (the Job object's, or the reader thread's); the last frees the core's buffers and
   files (its shell too, unless call records were handed out). */
void core_release(core_t *c);
/* The Job object is closing: a run in progress ends first (within its deadline); later ones return
   at once. Call without the GIL. */
void core_close(core_t *c);

#endif
