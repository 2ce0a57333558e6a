/* The fetch job's core, closed and freed: see lifecycle.h. */
#include "lifecycle.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include "direct_budget.h"
#include "reader.h"
#include "writer.h"

void core_release(core_t *c) {
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    reader_free(c);
    free(c->pos);
    c->pos = NULL;
    if (c->peer_pidfd >= 0) close(c->peer_pidfd);
    c->peer_pidfd = -1;
    writer_release(&c->stuck);
    budget_unmap(c);
    atomic_fetch_sub(&live_cores, 1);
    if (__atomic_load_n(&c->exposed, __ATOMIC_ACQUIRE)) return;  /* a captured graph may still run a call */
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->msg_lock);
    pthread_mutex_destroy(&c->rd.mu);
    pthread_cond_destroy(&c->rd.cv);
    for (int64_t i = 0; i < c->call_nchunks; i++) free(c->call_chunks[i]);
    free(c->call_chunks);
    free(c);
}

/* The Job object is closing: a run in progress ends first (within its deadline); later ones return
   at once. Call without the GIL. */
void core_close(core_t *c) {
    pthread_mutex_lock(&c->lock);
    const int was = c->closed;
    c->closed = 1;
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
    c->region = NULL;
    c->region_len = 0;
    c->board = NULL;
    c->split = 0;
    c->gate = NULL;
    pthread_mutex_unlock(&c->lock);
    if (!was) reader_quit(c);
}
