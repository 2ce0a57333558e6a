/* The C interface of engram_store.native._gather for other extension modules.
 *
 * A module that gathers rows without the GIL (the daemon's native Unix path)
 * imports it once with PyCapsule_Import(ENGRAM_GATHER_CAPSULE, 0) and so shares
 * the process's one pool of gather threads.
 */
#ifndef ENGRAM_GATHER_API_H
#define ENGRAM_GATHER_API_H

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
} engram_gather_api;

#endif
