/* The gather core of engram_store.native._gather (pool.c): one copy path for every layout of
 * gather_job_t (gather_api.h), on the caller's thread or a small pool of native threads. */
#ifndef ENGRAM_STORE_GATHER_POOL_H
#define ENGRAM_STORE_GATHER_POOL_H

#include <stdint.h>

#include "gather_api.h"

#define MIN_SPLIT_ROWS 2048 /* smaller gathers run on the caller's thread */

/* The whole gather, without the GIL: every index is checked before any row is copied, so on an error
   the destination is untouched. Returns -1 or the position of the first bad index. */
int64_t gather_run(const gather_job_t *job, int threads);
/* Wake idle workers: a gather is coming. */
void gather_prime(void);
/* Worker threads started in this process. */
int gather_pool_size(void);
/* Once, at module init: a forked child starts with an empty pool. */
void gather_pool_init(void);

#endif
