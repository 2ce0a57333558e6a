/* Linux native AIO for a batch_args_t (batch.h): io_setup / io_submit / io_getevents as raw
 * syscalls, completions reaped from the user-mapped ring as libaio does (no libaio needed).
 * One unit (aio.c) linked into _pread (read_batch / read_rows) and _fetch (the engines' direct page
 * reads); each extension has its own pool of contexts, keeping up to the number it gives aio_init().
 *
 *   batch_t b = {.fd = fd}; ...fill b.a (batch.h)...
 *   int64_t got = read_aio(&b, qd);   bytes read, or -1 where the kernel offers no AIO
 *   if (got < 0) got = read_sync(&b); one pread at a time
 *   b.err / b.err_off / b.short_read  the first failure (0: none)
 * Both run without the GIL and call batch_complete() as each extent arrives. A caller that may
 * give up on a batch sets b.cancel to a flag it raises from another thread (__atomic stores):
 * once raised, no further extent is submitted, the reads in flight are drained and b.cancelled
 * is 1 (the extents' rows are then incomplete).
 *
 * Drained contexts are pooled (io_setup/io_destroy are slow). A context belongs to the process
 * that set it up: fork() does not copy its ring, so aio_init() registers a pthread_atfork handler
 * and the child sets up its own.
 */
#ifndef ENGRAM_STORE_AIO_H
#define ENGRAM_STORE_AIO_H

#include <stdint.h>

#include "batch.h"

#define AIO_MAX_QD 256    /* events of one AIO context; larger queue depths are clamped by the callers */
#define AIO_MAX_POOL 64   /* idle contexts an extension may keep */

typedef struct {
    batch_args_t a;                  /* what the call asked for, checked (batch.h) */
    int fd;
    int err;                         /* errno of the first failure, 0 if none */
    int64_t err_off;                 /* file offset of the first failure */
    int short_read;                  /* the failure was a short read */
    const int *cancel;               /* NULL, or a flag another thread raises to stop submitting */
    int cancelled;                   /* the batch stopped early because *cancel was raised */
} batch_t;

/* Once, at module init: keep up to `keep` (<= AIO_MAX_POOL) drained contexts; registers the fork handler. */
void aio_init(int keep);
/* Bytes read, or -1 when AIO is unavailable (the caller falls back to read_sync); qd <= AIO_MAX_QD. */
int64_t read_aio(batch_t *b, int qd);
/* One pread at a time. */
int64_t read_sync(batch_t *b);

#endif
