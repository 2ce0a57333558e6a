/* The native path's cached layers: a lookup whose rows are all in the row cache, served without the
 * interpreter under the cache's own rule (storage/row_cache.py, native/gather/epoch_guard.h); a unit of
 * _unixfast (cached_hits.c).
 *
 * With the cache's guard held: every row mapped to its slot (any row not cached, or an id outside the
 * layer, and the lookup goes to Python, which reads the misses and answers errors), the slots' S3-FIFO
 * hit counts raised as RowCache.begin does, and the reader's epoch registered. Then, with the guard
 * released, the slots are gathered into the client's region, and the reader leaves: a slot evicted
 * meanwhile is not reused before that.
 */
#ifndef ENGRAM_STORE_CACHED_HITS_H
#define ENGRAM_STORE_CACHED_HITS_H

#include <Python.h>
#include <stdint.h>

typedef struct {
    int32_t layer;
    Py_buffer map; /* int32 [rows]: slot + 1, 0 when not cached */
} cached_layer_t;

typedef struct {
    cached_layer_t *layers;
    Py_ssize_t nlayers;
    Py_buffer slots, counts; /* uint8 [n_slots, row_bytes], uint8 [n_slots] */
    int have_slots, have_counts, count_cap;
    PyObject *guard;         /* an EpochGuard (strong reference) */
    int32_t *found;          /* [capacity] scratch: slot + 1 per row */
    int64_t *slot;           /* [capacity] scratch: slot per row */
    uint8_t *next;           /* [capacity] scratch: the raised hit counts */
} cache_t;

/* `views`: RowCache.native_views() (None: no cached layers). `capacity`: the most rows one lookup has. */
int cache_init(cache_t *k, PyObject *views, Py_ssize_t capacity, size_t row_bytes);
void cache_release(cache_t *k);
/* The cached layer `layer`, or NULL. */
const cached_layer_t *cache_layer(const cache_t *k, int32_t layer);
/* Rows ids[0..n) of `l` into out when every one is cached: 1, or 0 to leave the lookup to Python. */
int cache_serve(const cache_t *k, const cached_layer_t *l, const int64_t *ids, int64_t n, char *out,
                size_t row_bytes, int threads);
/* The same into a client's staging (split layout, row i at pos[i]) under its gate (staging_gate.h): 1 served,
   0 to leave it to Python (a miss, an id outside the layer, or the client gave the request up). */
int cache_serve_split(const cache_t *k, const cached_layer_t *l, const int64_t *ids, int64_t n, char *wout,
                      char *sout, const int64_t *pos, size_t weight_bytes, size_t scale_bytes, uint32_t *gate,
                      uint64_t request_id, int threads);

#endif
