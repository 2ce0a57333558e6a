/* The fetch job's native state (fetch/_fetch.c), shared by its parts: the reader thread
 * (reader.h), the daemon exchange (daemon.h) and the run function (_fetch.c). The bottom unit: core.c
 * (the clock, the messages) calls none of the others; the close and the frees are lifecycle.h's.
 *
 * Lifetime. A core lives on the heap, apart from the Python Job object: a captured CUDA graph
 * bakes a call record's address (fetch_call: core and row count) into its host node, and the
 * driver may run a queued host function after the engine dropped the job. So:
 *   - refs counts the Job object and the reader thread; the core's buffers and files go with the
 *     last of them (core_release, lifecycle.h);
 *   - closed (under lock) says the Job object is closed: a run finding it set returns at once,
 *     touching nothing else (the staging may be gone);
 *   - the shell (lock, closed, call records) of a core whose call records were handed out
 *     (call_address, launch_host: exposed) is never freed, so a late host function always finds
 *     a valid lock and the closed flag. It is a few KiB a job: a 4 KiB chunk of call records per
 *     256 row counts an engine launched (found in O(1); at most 16 bytes a staging row, where the
 *     staging itself takes 8 + row_bytes). Synchronous runs (run, run_in_native_thread) use none.
 * One run at a time (lock). The reader works on copies (its own ids, buffers, files) and never
 * touches the staging: only the run copies a result in, and only its own.
 */
#ifndef ENGRAM_STORE_FETCH_CORE_H
#define ENGRAM_STORE_FETCH_CORE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "aio.h"

#define MAX_STRIPES 64
#define MSG_BYTES 1024
#define SHOWN 6      /* rows and pages named in an error */
#define LAT_RING 128 /* daemon answers the hedge budget is measured over */
enum { ERR_NONE = 0, ERR_CORRUPT = 1, ERR_IO = 2 };

typedef struct core core_t;
typedef struct { core_t *core; int64_t rows; } fetch_call;
#define CALL_CHUNK 256 /* call records made together (4 KiB) */

/* A layer's page checksums in private memory (never a mapping of the .crc file: a file truncated
   under a mapping raises SIGBUS), shared by the jobs of one checksum file in a process. */
typedef struct {
    _Atomic int64_t refs;
    int64_t n;
    uint32_t crc[];
} crc_blob;

/* A file the direct reads use, as the job opened it: re-checked before and after each direct
   step (fstat of fd: size, mtime, ctime; stat of path: device and inode). */
typedef struct {
    int fd;
    char *path;
    int64_t dev, ino, size, mtime_ns, ctime_ns;
} watched_t;

enum { R_IDLE = 0, R_BUSY = 1, R_DONE = 2 };

/* The watch of a daemon's write into the staging (writer.h): its process, or its connection. */
typedef struct {
    int pidfd;      /* the daemon's pidfd, -1 when unknown */
    int sock;       /* else the connection (a dup), -1 when the step had dropped it */
    int64_t hup_ns; /* when the daemon's end of the connection was first seen hung up, 0 not yet */
} writer_t;

typedef struct {
    pthread_mutex_t mu;     /* state, gen, stuck, quit; the result is the run's once state is R_DONE */
    pthread_cond_t cv;
    int efd;                /* eventfd: one count per request done (the run polls it with the socket) */
    int started, quit, state, stuck;
    pid_t pid;              /* the process the thread runs in (a forked child starts its own) */
    void (*release)(core_t *c);  /* gives the thread's reference back at its end (reader_init's; lifecycle.h) */
    int cancel;             /* raised (__atomic) when the run gave up on the request: stop submitting */
    uint64_t gen;           /* request number */
    int64_t since;          /* when the current request was handed over (ns) */
    /* files */
    int nstripes, nwatch, qd;
    watched_t watch[MAX_STRIPES + 1];  /* the data file or its stripes, then the checksum file */
    crc_blob *crcs;
    /* the request, the reader's own copies */
    int64_t m;
    int64_t *rid;                      /* [max_rows] ids of the taken rows, in the run's order k */
    uint64_t *order;                   /* [max_rows] (stripe, stripe page, k) sort keys */
    int64_t *ext_off, *ext_len, *first_row, *row_off, *bad;
    uint8_t *packed;                   /* [max_rows, row_bytes] rows read, in sorted order */
    uint8_t *scratch;                  /* qd pages, 4 KiB aligned */
    int qd_now;                        /* this request's queue depth (the node's budget may give less than qd) */
    int32_t held[AIO_MAX_QD];              /* the budget's granules it holds (direct_budget.h), given back at its end */
    int nheld;
    /* the result */
    int64_t nbad, pages, err_off, err_stripe;
    int err, short_read, cancelled;
    char changed[MSG_BYTES];           /* a file changed since it was opened ("" none) */
} reader_t;

struct core {
    pthread_mutex_t lock;  /* one run at a time; attach/detach/close between runs */
    int closed, exposed;
    _Atomic int refs;
    /* geometry */
    int32_t layer;
    int64_t layer_rows, row_bytes, dim, scale_bytes, rows_per_page, max_rows, deadline_ns;
    /* the staging (valid while !closed): ids, payload block, scale block */
    int64_t *ids;
    uint8_t *weight, *scales;
    int64_t *pos;                      /* [max_rows] staging index of each taken row */
    /* the daemon (daemon.h) */
    int sock;                          /* -1: not connected */
    uint8_t *region;
    int64_t region_len, ids_off, out_off;
    uint64_t request_id, pending_id;   /* pending_id: a request a step gave up on, its answer not read yet */
    int64_t pending_since;
    int64_t hedge_fixed_ns;            /* > 0: a fixed hedge budget instead of the measured one */
    int64_t lat[LAT_RING];
    int nlat, lat_next, streak;
    int64_t backoff_ns, backoff_until;
    /* one host copy (engram_store/wire/staging.py, staging_gate.h): the daemon writes rows into the staging */
    uint32_t *gate;                    /* the staging memfd's gate word (valid while !closed), or NULL */
    int split;                         /* this connection's daemon took the staging: Flag.SPLIT lookups */
    int peer_pidfd;                    /* the connected daemon's process (pidfd), -1 when unknown */
    int64_t peer_hup_ns;               /* when this step dropped a connection whose daemon had hung up, 0 */
    uint64_t gate_stuck;               /* a request whose rows the daemon was still writing at a deadline */
    writer_t stuck;                    /* that write's watch (writer.h) */
    /* direct reads (reader.h) */
    reader_t rd;
    int budget_fd;                     /* the node's budget of direct pages in flight (direct_budget.h), -1 none */
    uint8_t *budget;                   /* its header page (mapped), or NULL: direct reads unbounded */
    uint32_t budget_next;              /* the granule this job tries first */
    /* status: counters are atomics, the messages sit under msg_lock (read by Python while a run goes on) */
    pthread_mutex_t msg_lock;
    char error[MSG_BYTES];             /* the first unreported failure ("" none) */
    int error_kind;
    int64_t error_pages[SHOWN];
    int error_npages;
    char note[MSG_BYTES];              /* the last fallback's reason */
    _Atomic int64_t steps, rows, daemon_steps, direct_steps, direct_pages, daemon_errors, drops, failed_steps,
        bad_pages, hedged_steps, busy_steps, backoff_steps, late_answers, timeouts, stuck_steps, last_ns, max_ns,
        total_ns, hedge_ns, one_copy_steps, copied_rows, gate_waits, dead_writers,
        hedged_direct_steps, fallback_direct_steps, waited_steps, budget_refusals;
    fetch_call **call_chunks;          /* [ceil((max_rows + 1) / CALL_CHUNK)]: the call records handed out, */
    int64_t call_nchunks, call_used;   /* record n at call_chunks[n / CALL_CHUNK][n % CALL_CHUNK] (chunks made
                                          on first use, never moved: call_address stays valid); used: chunks made */
    uint8_t *board;                    /* the failure board (board.h), or NULL; valid while !closed */
    int board_published;               /* this core wrote (or tried to write) its failure there */
};

extern _Atomic int64_t live_cores, late_calls;  /* cores not yet freed; runs that found their core closed */

/* CLOCK_MONOTONIC, ns. */
int64_t now_ns(void);
/* The core's messages (error, note), under msg_lock; the first error stands until reported. */
void set_text(core_t *c, char *dst, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* An I/O-kind failure of this step (the first unreported one stands). */
void set_io_error(core_t *c);

#endif
