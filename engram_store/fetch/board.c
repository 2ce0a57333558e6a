/* The fetch job's board: see board.h. */
#include "board.h"

#include <string.h>
#include <unistd.h>



void board_publish(core_t *c) {
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
    const size_t room = BOARD_BYTES - BOARD_MESSAGE - 1, len = strnlen(msg, room < sizeof msg ? room : sizeof msg);
    memcpy(b + BOARD_MESSAGE, msg, len);
    b[BOARD_MESSAGE + len] = 0;
    __atomic_store_n((uint32_t *)(b + BOARD_FAILED), 1, __ATOMIC_RELEASE);
}
