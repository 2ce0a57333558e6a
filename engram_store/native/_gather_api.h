/* The C interface of engram_store.native._gather for other extension modules.
 *
 * A module that gathers rows without the GIL (the daemon's native Unix path)
 * imports it once with PyCapsule_Import(ENGRAM_GATHER_CAPSULE, 0) and so shares
 * the process's one pool of gather threads.
 */
#ifndef ENGRAM_GATHER_API_H
#define ENGRAM_GATHER_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define ENGRAM_GATHER_CAPSULE "engram_store.native._gather._C_API"

typedef struct {
    /* out[i] = src[idx[i]] for n rows of row_bytes bytes, src holding `rows` rows, on up
       to `threads` threads. Returns -1, or the position of the first index outside
       [0, rows), in which case nothing was copied. Call it without holding the GIL. */
    int64_t (*gather)(const char *src, int64_t rows, size_t row_bytes, const int64_t *idx, int64_t n, char *out,
                      int threads);
    /* A gather is coming: wake idle pool threads now (see prime()). */
    void (*prime)(void);
    /* The same gather from a table kept in two blocks (engine layout): out row i is the
       weight_bytes of weights[idx[i]] then the scale_bytes of scales[idx[i]]. */
    int64_t (*gather_split)(const char *weights, const char *scales, int64_t rows, size_t weight_bytes,
                            size_t scale_bytes, const int64_t *idx, int64_t n, char *out, int threads);
    /* out[i] = table[idx[i]] for int32 entries, prefetched (the row cache's row-to-slot maps). Returns -1,
       or the first i whose index is outside [0, len). */
    int64_t (*take_int32)(const int32_t *table, int64_t len, const int64_t *idx, int64_t n, int32_t *out);
    /* counts[idx[i]] = min(counts[idx[i]], cap - 1) + 1, numpy's semantics for repeated indices (S3-FIFO's
       hit counts); idx int64 (idx_bytes 8) or int32 (4); `next` is n bytes of scratch. Returns -1, or the
       first i whose index is outside [0, len) (nothing written then). */
    int64_t (*bump_counts)(uint8_t *counts, int64_t len, const void *idx, int idx_bytes, int64_t n, int cap,
                           uint8_t *next);
    /* The row cache's lock and reader epochs (epoch_guard.h); `guard` is an instance of guard_type. */
    PyTypeObject *guard_type;
    void (*guard_lock)(void *guard);
    void (*guard_unlock)(void *guard);
    int64_t (*guard_enter)(void *guard); /* lock held; the reader's token, -1 when out of memory */
    void (*guard_leave)(void *guard, int64_t token); /* takes the lock */
    /* Into a client's staging, split layout (one host copy): row i of a packed table (row_bytes =
       weight_bytes + scale_bytes) goes to weights_out + pos[i] * weight_bytes and scales_out +
       pos[i] * scale_bytes. Every idx is checked first (as gather); the caller checks pos. */
    int64_t (*gather_to_split)(const char *src, int64_t rows, size_t weight_bytes, size_t scale_bytes,
                               const int64_t *idx, int64_t n, char *weights_out, char *scales_out, const int64_t *pos,
                               int threads);
    /* The same from a split table (the resident arena's two blocks). */
    int64_t (*gather_split_to_split)(const char *weights, const char *scales, int64_t rows, size_t weight_bytes,
                                     size_t scale_bytes, const int64_t *idx, int64_t n, char *weights_out,
                                     char *scales_out, const int64_t *pos, int threads);
} engram_gather_api;

#endif
