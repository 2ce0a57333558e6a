/* The C interface of engram_store.native._gather for other extension modules.
 *
 * A module that gathers rows without the GIL (the daemon's native Unix path) imports it once with
 * PyCapsule_Import(ENGRAM_GATHER_CAPSULE, 0) and so shares the process's one pool of gather threads.
 * Its include path names engram_store/native/gather (setup.py include_dirs).
 */
#ifndef ENGRAM_GATHER_API_H
#define ENGRAM_GATHER_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define ENGRAM_GATHER_CAPSULE "engram_store.native._gather._C_API"

/* One gather: rows idx[0..n) of a source of `rows` rows, each row_bytes + row_bytes2 bytes, into a
 * destination. The layouts, as the fields set:
 *   source       packed (src2 NULL): row r at src + r * (row_bytes + row_bytes2)
 *                split (src2 set):   row r's first row_bytes at src + r * row_bytes, the rest at
 *                                    src2 + r * row_bytes2 (the engines' layout: payloads, then scales)
 *   destination  packed (pos NULL):  row i at out + i * (row_bytes + row_bytes2)
 *                split (pos set):    row i's first row_bytes at wout + pos[i] * row_bytes, the rest at
 *                                    sout + pos[i] * row_bytes2 (a client's staging, one host copy)
 * Every idx is checked before any row is copied; positions are the caller's to check. */
typedef struct {
    const char *src, *src2;
    const int64_t *idx;
    int64_t n, rows;
    size_t row_bytes, row_bytes2;
    char *out;
    const int64_t *pos;
    char *wout, *sout;
} gather_job_t;

typedef struct {
    /* The gather on up to `threads` threads. Returns -1, or the position of the first index outside
       [0, rows), in which case nothing was copied. Call it without holding the GIL. */
    int64_t (*run)(const gather_job_t *job, int threads);
    /* A gather is coming: wake idle pool threads now (see prime()). */
    void (*prime)(void);
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
} engram_gather_api;

#endif
