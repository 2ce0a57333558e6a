/* The node's budget of direct page reads in flight (fetch/_fetch.c), shared by every fetch job on the
 * node that reads the same device: hedged and fallback direct reads of all of them stay within it, so a
 * slow daemon (usually a busy disk) is not answered by every job reading the same disk at once.
 *
 * The budget is a small file (engram_store/fetch/budget.py makes and sizes it: the device's
 * queue depth from sysfs, or ENGRAM_STORE_DIRECT_BUDGET_PAGES): a header page, and `granules` granules
 * of `granule_pages` pages each. A job holds a granule while it holds an OFD lock (F_OFD_SETLK) on byte
 * BUDGET_LOCKS + g of the file, through an open file description of its own: the kernel drops the locks
 * of a process that dies, so a crashed engine never keeps any of the budget. A direct read of a job
 * takes what it may use (its queue depth, at most the request's pages) in granules, at least one, and
 * reads at the depth it got; with none free it gets none (the run then waits for the daemon, or for the
 * budget, to its deadline: run.h). The reader gives the granules back when its read ends (a read
 * the run gave up on keeps them until then: its pages are still in flight).
 *
 * The header's counters (pages reserved now, the most reserved at once, refusals) are for metrics
 * and the benchmark only: the locks are the budget. Each granule has a mark in the second page (set by
 * its holder, cleared before it lets go), so a granule whose holder died holding it (a process exits
 * with a read in flight) stays counted once, not twice, until the next holder takes it over. Its layout is engram_store/fetch/budget.py's LAYOUT, which Python checks
 * against BUDGET_OFFSETS (the module's constant) before it hands a budget over.
 *
 *   budget_take(c, pages, held, &n)   granules for a read of `pages` pages in flight at most: the pages
 *                                      it may read at once (n granules in held), 0 none free
 *   budget_give(c, held, n)
 */
#ifndef ENGRAM_STORE_FETCH_DIRECT_BUDGET_H
#define ENGRAM_STORE_FETCH_DIRECT_BUDGET_H

#include <stdint.h>

#include "core.h"

#define BUDGET_MAGIC 0x54474442u /* "BDGT" */
#define BUDGET_VERSION 2
#define BUDGET_HEADER_BYTES 4096
#define BUDGET_FILE_BYTES 8192
#define BUDGET_MAGIC_AT 0      /* u32 */
#define BUDGET_VERSION_AT 4    /* u32 */
#define BUDGET_GRANULES_AT 8   /* u32: granules in the budget now (the last sizing wins) */
#define BUDGET_GRANULE_AT 12   /* u32: pages a granule */
#define BUDGET_RESERVED_AT 16  /* i64: pages reserved now, all jobs */
#define BUDGET_MAX_AT 24       /* i64: the most pages reserved at once */
#define BUDGET_REFUSED_AT 32   /* i64: direct reads refused (none free) */
#define BUDGET_LOCKS 4096      /* granule g: an OFD lock on byte BUDGET_LOCKS + g */
#define BUDGET_HELD_AT 4096    /* u8[BUDGET_MAX_GRANULES]: granule g counted in `reserved` (its holder's mark) */
#define BUDGET_MAX_GRANULES 4096

/* 0, or -1 when fd is not a budget file (errno set). */
int budget_map(core_t *c, int fd);
void budget_unmap(core_t *c);
int64_t budget_take(core_t *c, int64_t pages, int32_t *held, int *nheld);
/* The budget's pages now, 0 without one. */
int64_t budget_pages(core_t *c);
/* Whether some of the budget looks free (the counters: a hint, never the budget itself); 1 without one. */
int budget_room(core_t *c);
void budget_give(core_t *c, const int32_t *held, int nheld);

#endif
