/* The failure board (engram_store/integrations/failures.py): one 4 KiB page of shared memory that every
 * rank of an engine server maps. A run that failed writes its failure there once, before the step's rows
 * are used (the run function returns after this), so the rank that returns the step's tokens stops even
 * when the failure was another rank's. The layout is failures.BOARD's; BOARD_OFFSETS (the module's
 * constant) lets Python check it. The first failure of all ranks wins: a claim word taken with a
 * compare-and-swap, the fields, then the failed flag (release), which readers test first.
 */
#ifndef ENGRAM_STORE_FETCH_BOARD_H
#define ENGRAM_STORE_FETCH_BOARD_H

#include <stdint.h>

#include "core.h"

#define BOARD_BYTES 4096
#define BOARD_FAILED 8    /* u32: 0, then 1 once the fields below are whole */
#define BOARD_KIND 12     /* u32: ERR_CORRUPT or ERR_IO */
#define BOARD_PID 16      /* i32: the process that failed */
#define BOARD_LAYER 20    /* i32 */
#define BOARD_NPAGES 24   /* u32: pages shown below */
#define BOARD_CLAIM 28    /* u32: 0, then 1 for the writer that won */
#define BOARD_PAGES 64    /* i64[SHOWN] */
#define BOARD_MESSAGE 112 /* UTF-8, NUL-terminated, to the end of the page */

/* Write the core's unreported failure to its board, once per core (the board keeps the first of all). */
void board_publish(core_t *c);

#endif
