/* The parts of the daemon's native path (_unixfast.c) that its units share (cached_hits.c,
 * staging_serve.c): a connection (Conn), the gather pool's C API, the fair share of large lookups, the
 * clock, the socket send, a connection's staging given up. Defined in unixfast_io.c, a unit of _unixfast
 * below the others: it calls none of them.
 */
#ifndef ENGRAM_STORE_UNIXFAST_IO_H
#define ENGRAM_STORE_UNIXFAST_IO_H

#include <Python.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cached_hits.h" /* cache_t */
#include "gather_api.h"  /* engram_gather_api */

#define FAIR_PIECE_ROWS 65536   /* larger lookups are gathered in pieces of this many rows; each piece is a hand-off to the gather pool (a 196,608-row prefill through the daemon: 0.89-0.90x in-process at 65,536, 0.79-0.88x at 16,384) */

typedef struct {
    int32_t layer;
    Py_buffer weights, scales;
} layer_t;

typedef struct {
    PyObject_HEAD
    int fd;
    int open;
    Py_buffer region, ids;
    layer_t *layers;
    Py_ssize_t nlayers;
    size_t row_bytes, weight_bytes;
    int threads;
    uint64_t max_rows;
    int64_t busy_poll_ns;
    cache_t cache; /* cached layers (cached_hits.h); none when nlayers is 0 */
    /* the client's staging (set_staging): Flag.SPLIT lookups write into it */
    int has_staging;
    Py_buffer st_weights, st_scales, st_gate;
    int64_t st_rows;
    int64_t *pos; /* [ids capacity] staging row of each taken id */
} Conn;

extern const engram_gather_api *gather_api; /* engram_store.native._gather's, set at module init (_unixfast.c) */

/* The fair share of every Conn of this process: a small lookup counts itself in small_active while it
   gathers (then small_done()); a piece of a large one calls yield_to_small() first and counts itself
   in pieces_served, and in pieces_yielded when it waited. */
extern _Atomic uint32_t small_active;
extern _Atomic uint64_t pieces_served, pieces_yielded;
void small_done(void);
void yield_to_small(void);
/* fork() copies only the calling thread: small lookups of threads that do not exist there are void
   (pthread_atfork's child handler). */
void reset_fair_share_in_child(void);

/* CLOCK_MONOTONIC, ns. */
int64_t now_ns(void);
/* Send all of data (MSG_NOSIGNAL); 0, or -1 when the socket failed. */
int send_all(int fd, const void *data, size_t len);
/* Give up the client's staging (set_staging), if any. */
void release_staging(Conn *c);

#endif
