/* The failure board (engram_store/integrations/failures.py): one 4 KiB page of shared memory that every
 * rank of an engine server maps. A run that failed writes its failure there once, before the step's rows
 * are used (the run function returns after this), so the rank that returns the step's tokens stops even
 * when the failure was another rank's. The layout is failures.BOARD's; BOARD_OFFSETS (the module's
 * constant) lets Python check it. The first failure of all ranks wins: a claim word taken with a
 * compare-and-swap, the fields, then the failed flag (release), which readers test first.
 * Include after fetch_core.h.
 */
#ifndef ENGRAM_STORE_FETCH_BOARD_H
#define ENGRAM_STORE_FETCH_BOARD_H

#include <string.h>
#include <unistd.h>

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
static void board_publish(core_t *c) {
    uint8_t *b = c->board;
    if (b == NULL || c->board_published) return;
    char msg[MSG_BYTES];
    int64_t pages[SHOWN];
    int kind, npages;
    pthread_mutex_lock(&c->msg_lock);
    memcpy(msg, c->error, MSG_BYTES);
    kind = c->error_kind;
    npages = c->error_npages;
    memcpy(pages, c->error_pages, sizeof pages);
    pthread_mutex_unlock(&c->msg_lock);
    if (!msg[0]) return;
    c->board_published = 1;
    uint32_t unclaimed = 0;
    if (!__atomic_compare_exchange_n((uint32_t *)(b + BOARD_CLAIM), &unclaimed, 1, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return;  /* another failure (this rank's or another's) is on the board already */
    const uint32_t k = (uint32_t)kind, np = (uint32_t)(kind == ERR_CORRUPT ? npages : 0);
    const int32_t pid = (int32_t)getpid(), layer = c->layer;
    memcpy(b + BOARD_KIND, &k, 4);
    memcpy(b + BOARD_PID, &pid, 4);
    memcpy(b + BOARD_LAYER, &layer, 4);
    memcpy(b + BOARD_NPAGES, &np, 4);
    memcpy(b + BOARD_PAGES, pages, sizeof pages);
    const size_t room = BOARD_BYTES - BOARD_MESSAGE - 1, len = strnlen(msg, room);
    memcpy(b + BOARD_MESSAGE, msg, len);
    b[BOARD_MESSAGE + len] = 0;
    __atomic_store_n((uint32_t *)(b + BOARD_FAILED), 1, __ATOMIC_RELEASE);
}

#endif
