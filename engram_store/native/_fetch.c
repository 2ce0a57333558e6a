/* The engines' fetch job: one step's Engram rows of one cached layer, fetched by native code that a
 * CUDA host function can run (no GIL, no CUDA call, no Python).
 *
 * Job(layer, layer_rows, row_bytes, dim, rows_per_page, staging, crcs, stripe_fds, queue_depth,
 *     deadline_seconds)
 *     `staging` is a writable buffer the job owns for its life (the caller registers it with the GPU):
 *     int64 ids [max_rows], then the payload block uint8 [max_rows, dim], then the scale block
 *     uint8 [max_rows, row_bytes - dim], each starting on a 4 KiB boundary (max_rows is derived
 *     from the buffer's size). Row i of the blocks is the row of ids[i]: the engines' kernels read
 *     the blocks as `weight` / `weight_scale_inv` with positional ids. `crcs` is the layer's page
 *     checksums (uint32 per page, in layer page order); `stripe_fds` the layer's data file (one fd)
 *     or its K stripes, opened O_DIRECT (the job takes the fds and closes them).
 *
 * engram_fetch_host_fn(void *call) is the run function: `call` (call_address(n)) names the job and
 * the row count n of one step (a captured CUDA graph bakes the pointer in, so there is one call per
 * count, kept for the job's life). It
 *   1. zeroes rows whose id is outside [0, layer_rows) (padding: the engines' kernels read zeros
 *      for ids they do not own), and takes the others;
 *   2. when connected to the daemon (attach()), writes their ids into the connection's shared
 *      region, sends one LOOKUP and waits for the RESULT until the deadline, then copies each row
 *      into its two blocks;
 *   3. otherwise, or when the daemon failed, answered an error or let the deadline pass, reads the
 *      rows' distinct 4 KiB pages itself (Linux AIO, queue_depth in flight, stripes one after
 *      another), checks each against its crc32c before any row of it is used, and copies the rows
 *      out. A page that fails leaves its rows zero and is recorded: error() then names layer,
 *      rows and pages, and the engine raises at its next host-visible point. A daemon that failed
 *      at the transport (gone, stopped, past the deadline) is dropped: connected is false until
 *      attach() gives the job a new connection (the Python side reconnects in the background).
 *   One run at a time (a mutex); the status of each run is kept (stats(), error()).
 *
 * Python: run(n) (the GIL released), run_in_native_thread(n) (a pthread of its own: proof that no
 * GIL is needed), launch_host(stream, n) (cuLaunchHostFunc or hipLaunchHostFunc, whichever GPU runtime
 * torch runs on: gpu_runtime.h; the job needs neither at build time), run_address / call_address(n), attach(fd,
 * region, ids_offset, out_offset), detach(), probe(), connected, stats(), error(), clear_error().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_QD 256
#define CTX_POOL 8

#include "crc32c.h"  /* PAGE, crc_init */
#include "batch.h"   /* batch_args_t, batch_complete (the page check and row copy) */
#include "aio.h"     /* batch_t, read_aio, read_sync */
#include "frame.h"   /* frame_t, MAGIC, VERSION, OP_*, DTYPE_INT64, frame_fields() */
#include "gpu_runtime.h"  /* gpu_launcher_get: the host-function launch of the GPU runtime torch runs on */

#define MAX_STRIPES 64
#define MSG_BYTES 1024
#define SHOWN 6  /* rows and pages named in an error */
enum { ERR_NONE = 0, ERR_CORRUPT = 1, ERR_IO = 2 };

typedef struct Job Job;
typedef struct { Job *job; int64_t rows; } fetch_call;

struct Job {
    PyObject_HEAD
    pthread_mutex_t lock;  /* one run at a time; attach/detach between runs */
    int lock_ready;
    /* geometry */
    int32_t layer;
    int64_t layer_rows, row_bytes, dim, scale_bytes, rows_per_page, max_rows, deadline_ns;
    /* staging: ids, payload block, scale block */
    Py_buffer staging;
    int64_t *ids;
    uint8_t *weight, *scales;
    /* direct reads */
    Py_buffer crcs_view;
    const uint32_t *crcs;
    int64_t ncrcs;
    int nstripes, stripe_fd[MAX_STRIPES], qd;
    uint8_t *scratch;                 /* qd pages, 4 KiB aligned */
    int64_t *pos;                     /* [max_rows] staging index of each taken row */
    uint64_t *order;                  /* [max_rows] (stripe, stripe page, k) sort keys, then row order */
    int64_t *ext_off, *ext_len, *first_row, *row_off, *bad;  /* [max_rows (+1)] one stripe's batch */
    uint8_t *packed;                  /* [max_rows, row_bytes] rows read directly, in sorted order */
    /* the daemon */
    int sock;                         /* -1: not connected */
    Py_buffer region;
    int has_region;
    int64_t ids_off, out_off;
    uint64_t request_id;
    /* status: counters are atomics, the message sits under msg_lock (read by Python while a run goes on) */
    pthread_mutex_t msg_lock;
    char error[MSG_BYTES];            /* the first unreported failure ("" none) */
    int error_kind;                   /* ERR_CORRUPT or ERR_IO */
    int64_t error_pages[SHOWN];       /* ERR_CORRUPT: the first bad pages */
    int error_npages;
    char note[MSG_BYTES];             /* the last fallback's reason (daemon gone, error, deadline) */
    _Atomic int64_t steps, rows, daemon_steps, direct_steps, direct_pages, daemon_errors, drops, failed_steps,
        bad_pages, last_ns, max_ns, total_ns;
    fetch_call **calls;               /* one per distinct row count, never freed before the job */
    int ncalls, cap_calls;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void set_text(Job *j, char *dst, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_text(Job *j, char *dst, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&j->msg_lock);
    if (dst != j->error || !dst[0]) vsnprintf(dst, MSG_BYTES, fmt, ap);  /* the first error stands until reported */
    pthread_mutex_unlock(&j->msg_lock);
    va_end(ap);
}

/* --- the daemon ----------------------------------------------------------------------------- */
static void drop(Job *j, const char *why) {
    if (j->sock >= 0) close(j->sock);
    j->sock = -1;
    atomic_fetch_add(&j->drops, 1);
    set_text(j, j->note, "layer %d: the daemon connection was dropped (%s); rows are read from the table files "
             "until it is back", j->layer, why);
}

/* 0, or -ETIMEDOUT / -errno / -EPIPE (peer closed) */
static int io_all(int fd, void *buf, size_t n, int64_t deadline, int sending) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = sending ? send(fd, (char *)buf + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, (char *)buf + done, n - done, MSG_DONTWAIT);
        if (r > 0) { done += (size_t)r; continue; }
        if (r == 0) return -EPIPE;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int64_t left = deadline - now_ns();
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
        int ms = (int)((left + 999999) / 1000000);
        if (poll(&p, 1, ms) < 0 && errno != EINTR) return -errno;
    }
    return 0;
}

/* Row k of the packed rows at src (row_bytes each) goes to staging row pos[k]: its payload into the
   payload block, its scales into the scale block. DeepSeek-V4.1's 256 + 8 bytes get copies of constant
   size (inlined vector moves); other row formats the general loop. */
static void split_rows(Job *j, const uint8_t *src, int64_t m) {
    const int64_t rb = j->row_bytes, dim = j->dim, sb = j->scale_bytes;
    const int64_t *pos = j->pos;
    if (dim == 256 && sb == 8) {
        for (int64_t k = 0; k < m; k++) {
            const uint8_t *row = src + k * 264;
            memcpy(j->weight + pos[k] * 256, row, 256);
            memcpy(j->scales + pos[k] * 8, row + 256, 8);
        }
        return;
    }
    for (int64_t k = 0; k < m; k++) {
        memcpy(j->weight + pos[k] * dim, src + k * rb, (size_t)dim);
        memcpy(j->scales + pos[k] * sb, src + k * rb + dim, (size_t)sb);
    }
}

/* 1: the daemon wrote every taken row into the blocks; 0: fall back to direct reads. */
static int from_daemon(Job *j, int64_t m) {
    if (j->ids_off + m * 8 > j->region.len || j->out_off + m * j->row_bytes > j->region.len) {
        set_text(j, j->note, "layer %d: %lld rows do not fit the shared region", j->layer, (long long)m);
        return 0;
    }
    uint8_t *region = j->region.buf;
    int64_t *ids = (int64_t *)(region + j->ids_off);
    for (int64_t k = 0; k < m; k++) ids[k] = j->ids[j->pos[k]];
    frame_t f = {.magic = MAGIC, .version = VERSION, .op = OP_LOOKUP, .dtype = DTYPE_INT64, .layer = j->layer,
                 .request_id = ++j->request_id, .count = (uint64_t)m, .ids_offset = (uint64_t)j->ids_off,
                 .out_offset = (uint64_t)j->out_off};
    const int64_t deadline = now_ns() + j->deadline_ns;
    frame_t r;
    int rc = io_all(j->sock, &f, sizeof f, deadline, 1);
    if (rc == 0) rc = io_all(j->sock, &r, sizeof r, deadline, 0);
    if (rc != 0) {
        drop(j, rc == -ETIMEDOUT ? "no answer within the deadline" : rc == -EPIPE ? "it closed the connection"
                                                                              : strerror(-rc));
        return 0;
    }
    if (r.magic != MAGIC || r.version != VERSION || r.op != OP_RESULT || r.request_id != f.request_id ||
        r.payload_bytes > MAX_DAEMON_PAYLOAD) {
        drop(j, "a frame that is not the answer");
        return 0;
    }
    if (r.payload_bytes) {  /* an error message: keep the first MSG_BYTES - 1 bytes */
        char msg[MSG_BYTES], sink[4096];
        uint32_t keep = r.payload_bytes < MSG_BYTES - 1 ? r.payload_bytes : MSG_BYTES - 1, left = r.payload_bytes - keep;
        rc = io_all(j->sock, msg, keep, deadline, 0);
        msg[rc == 0 ? keep : 0] = 0;
        while (rc == 0 && left) {
            uint32_t n = left < sizeof sink ? left : (uint32_t)sizeof sink;
            rc = io_all(j->sock, sink, n, deadline, 0);
            left -= n;
        }
        if (rc != 0) {
            drop(j, "its answer was cut short");
            return 0;
        }
        if (r.status) set_text(j, j->note, "layer %d: the daemon answered status %u: %s", j->layer, r.status, msg);
    }
    if (r.status) {
        atomic_fetch_add(&j->daemon_errors, 1);
        return 0;
    }
    split_rows(j, region + j->out_off, m);
    return 1;
}

/* --- direct reads --------------------------------------------------------------------------- */
static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

#define KEY_ROW_BITS 22   /* sort keys: stripe (6 bits, MAX_STRIPES) | page in the stripe | k < 2^22 rows a run */
#define KEY_PAGE_BITS 36

/* Reads every taken row's page from the table files, checked; returns 0, or -1 when a read failed. */
static int from_files(Job *j, int64_t m) {
    const int64_t K = j->nstripes, rpp = j->rows_per_page, rb = j->row_bytes;
    for (int64_t k = 0; k < m; k++) {
        const int64_t page = j->ids[j->pos[k]] / rpp;
        j->order[k] = ((uint64_t)(page % K) << (KEY_PAGE_BITS + KEY_ROW_BITS)) |
                      ((uint64_t)(page / K) << KEY_ROW_BITS) | (uint64_t)k;
    }
    qsort(j->order, (size_t)m, sizeof(uint64_t), cmp_u64);
    if (j->packed == NULL && (j->packed = malloc((size_t)(j->max_rows * rb))) == NULL) {  /* first direct read */
        set_text(j, j->error, "layer %d: no memory for %lld rows read directly", j->layer, (long long)j->max_rows);
        return -1;
    }
    memset(j->packed, 0, (size_t)(m * rb));  /* rows of a page that fails stay zero */
    int64_t nbad_total = 0, pages_read = 0, q = 0;
    int failed = 0;
    while (q < m && !failed) {  /* one batch per stripe */
        const int64_t stripe = (int64_t)(j->order[q] >> (KEY_PAGE_BITS + KEY_ROW_BITS));
        const int64_t start = q;
        int64_t n_ext = 0, last = -1;
        for (; q < m && (int64_t)(j->order[q] >> (KEY_PAGE_BITS + KEY_ROW_BITS)) == stripe; q++) {
            const int64_t local = (int64_t)((j->order[q] >> KEY_ROW_BITS) & (((uint64_t)1 << KEY_PAGE_BITS) - 1));
            const int64_t k = (int64_t)(j->order[q] & (((uint64_t)1 << KEY_ROW_BITS) - 1));
            if (local != last) {
                j->ext_off[n_ext] = local * PAGE;
                j->ext_len[n_ext] = PAGE;
                j->first_row[n_ext] = q - start;
                n_ext++;
                last = local;
            }
            j->row_off[q - start] = (j->ids[j->pos[k]] % rpp) * rb;
        }
        j->first_row[n_ext] = q - start;
        batch_t b = {.fd = j->stripe_fd[stripe]};
        b.a.n = b.a.n_len = b.a.n_dst = n_ext;
        b.a.off = j->ext_off;
        b.a.len = j->ext_len;
        b.a.out = (char *)(j->packed + start * rb);
        b.a.row_bytes = rb;
        b.a.first_row = j->first_row;
        b.a.n_first = n_ext + 1;
        b.a.row_off = j->row_off;
        b.a.rows = b.a.out_len = q - start;
        b.a.scratch = (char *)j->scratch;
        b.a.slot = PAGE;
        b.a.crcs = j->crcs;
        b.a.ncrcs = j->ncrcs;
        b.a.crc_stride = K;
        b.a.crc_phase = stripe;
        b.a.bad = j->bad + nbad_total;
        int64_t got = read_aio(&b, j->qd);
        if (got < 0) got = read_sync(&b);
        pages_read += n_ext;
        nbad_total += b.a.nbad;
        if (b.err) {
            pthread_mutex_lock(&j->msg_lock);
            if (!j->error[0]) j->error_kind = ERR_IO, j->error_npages = 0;
            pthread_mutex_unlock(&j->msg_lock);
            set_text(j, j->error, "layer %d: reading page at byte %lld of stripe %lld of its table file failed: %s; "
                     "%lld rows of this step are zero", j->layer, (long long)b.err_off, (long long)stripe,
                     b.short_read ? "short read (file truncated?)" : strerror(b.err), (long long)m);
            failed = 1;
        }
    }
    atomic_fetch_add(&j->direct_pages, pages_read);
    if (failed) {
        memset(j->packed, 0, (size_t)(m * rb));
    } else if (nbad_total) {
        char pages[512];
        size_t used = (size_t)snprintf(pages, sizeof pages, "pages");
        for (int64_t b = 0; b < nbad_total && b < SHOWN && used < sizeof pages; b++)
            used += (size_t)snprintf(pages + used, sizeof pages - used, "%s%lld", b ? ", " : " ", (long long)j->bad[b]);
        if (nbad_total > SHOWN && used < sizeof pages)
            snprintf(pages + used, sizeof pages - used, " and %lld more", (long long)(nbad_total - SHOWN));
        char rows[512];
        used = (size_t)snprintf(rows, sizeof rows, "rows");
        int shown = 0;
        for (int64_t k = 0; k < m && shown < SHOWN && used < sizeof rows; k++) {
            const int64_t page = j->ids[j->pos[k]] / rpp;
            for (int64_t b = 0; b < nbad_total; b++) {
                if (j->bad[b] == page) {
                    used += (size_t)snprintf(rows + used, sizeof rows - used, "%s%lld", shown ? ", " : " ",
                                             (long long)j->ids[j->pos[k]]);
                    shown++;
                    break;
                }
            }
        }
        atomic_fetch_add(&j->bad_pages, nbad_total);
        pthread_mutex_lock(&j->msg_lock);
        if (!j->error[0]) {
            j->error_kind = ERR_CORRUPT;
            j->error_npages = (int)(nbad_total < SHOWN ? nbad_total : SHOWN);
            memcpy(j->error_pages, j->bad, (size_t)j->error_npages * 8);
        }
        pthread_mutex_unlock(&j->msg_lock);
        set_text(j, j->error, "layer %d: %lld page(s) of its table file failed their crc32c check (%s; %s): no good "
                 "copy of those rows exists (the daemon refused them or was not there); their rows are zero in this "
                 "step; repair the table set (engram-store verify names every bad page) and restart the daemon",
                 j->layer, (long long)nbad_total, pages, rows);
    }
    const int64_t dim = j->dim, sb = j->scale_bytes;
    for (int64_t s = 0; s < m; s++) {  /* sorted position s holds row k */
        const int64_t i = j->pos[(int64_t)(j->order[s] & (((uint64_t)1 << KEY_ROW_BITS) - 1))];
        memcpy(j->weight + i * dim, j->packed + s * rb, (size_t)dim);
        memcpy(j->scales + i * sb, j->packed + s * rb + dim, (size_t)sb);
    }
    return failed || nbad_total ? -1 : 0;
}

/* --- the run function --------------------------------------------------------------------------- */
static void job_run(Job *j, int64_t n) {
    const int64_t t0 = now_ns();
    pthread_mutex_lock(&j->lock);
    if (n > j->max_rows) n = j->max_rows;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = j->ids[i];
        if (id >= 0 && id < j->layer_rows) {
            j->pos[m++] = i;
        } else {  /* padding: zeros, as the engines' kernels read for ids they do not own */
            memset(j->weight + i * j->dim, 0, (size_t)j->dim);
            memset(j->scales + i * j->scale_bytes, 0, (size_t)j->scale_bytes);
        }
    }
    int served = m == 0;
    if (!served && j->sock >= 0) served = from_daemon(j, m);
    if (served) {
        atomic_fetch_add(&j->daemon_steps, m > 0);
    } else {
        atomic_fetch_add(&j->direct_steps, 1);
        if (from_files(j, m) < 0) atomic_fetch_add(&j->failed_steps, 1);
    }
    pthread_mutex_unlock(&j->lock);
    const int64_t dt = now_ns() - t0;
    atomic_fetch_add(&j->steps, 1);
    atomic_fetch_add(&j->rows, m);
    atomic_store(&j->last_ns, dt);
    atomic_fetch_add(&j->total_ns, dt);
    for (int64_t mx = atomic_load(&j->max_ns); dt > mx && !atomic_compare_exchange_weak(&j->max_ns, &mx, dt);) {
    }
}

/* What cudaLaunchHostFunc runs (and the CPU path calls): no GIL, no CUDA, no Python. */
void engram_fetch_host_fn(void *call) {
    fetch_call *c = call;
    job_run(c->job, c->rows);
}

static void *thread_main(void *call) {
    engram_fetch_host_fn(call);
    return NULL;
}

/* --- Python ----------------------------------------------------------------------------------- */
static int64_t up_to_page(int64_t x) { return (x + PAGE - 1) / PAGE * PAGE; }

static void job_close_files(Job *j) {
    for (int s = 0; s < j->nstripes; s++)
        if (j->stripe_fd[s] >= 0) close(j->stripe_fd[s]);
    j->nstripes = 0;
}

static void job_dealloc(Job *j) {
    if (j->lock_ready) {
        if (j->sock >= 0) close(j->sock);
        pthread_mutex_destroy(&j->lock);
        pthread_mutex_destroy(&j->msg_lock);
    }
    job_close_files(j);
    if (j->has_region) PyBuffer_Release(&j->region);
    if (j->staging.obj) PyBuffer_Release(&j->staging);
    if (j->crcs_view.obj) PyBuffer_Release(&j->crcs_view);
    free(j->scratch); free(j->pos); free(j->order); free(j->ext_off); free(j->ext_len); free(j->first_row);
    free(j->row_off); free(j->bad); free(j->packed);
    for (int i = 0; i < j->ncalls; i++) free(j->calls[i]);
    free(j->calls);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

static int job_init(Job *j, PyObject *args, PyObject *kw) {
    static char *names[] = {"layer", "layer_rows", "row_bytes", "dim", "rows_per_page", "staging", "crcs",
                            "stripe_fds", "queue_depth", "deadline_seconds", NULL};
    int layer, qd;
    long long layer_rows, row_bytes, dim, rpp;
    double deadline;
    PyObject *o_staging, *o_crcs, *o_fds;
    if (j->lock_ready) {
        PyErr_SetString(PyExc_RuntimeError, "Job is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLLLLOOOid", names, &layer, &layer_rows, &row_bytes, &dim, &rpp,
                                     &o_staging, &o_crcs, &o_fds, &qd, &deadline))
        return -1;
    j->sock = -1;
    for (int s = 0; s < MAX_STRIPES; s++) j->stripe_fd[s] = -1;
    if (layer_rows <= 0 || dim <= 0 || row_bytes <= dim || rpp <= 0 || rpp * row_bytes > PAGE || !(deadline > 0)) {
        PyErr_SetString(PyExc_ValueError, "Job: layer_rows, dim > 0; row_bytes > dim; rows_per_page * row_bytes "
                                          "<= 4096; deadline_seconds > 0");
        return -1;
    }
    if (PyObject_GetBuffer(o_staging, &j->staging, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(o_crcs, &j->crcs_view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (j->crcs_view.itemsize != 4 && j->crcs_view.itemsize != 1) {
        PyErr_SetString(PyExc_TypeError, "crcs must be a uint32 buffer");
        return -1;
    }
    j->layer = layer;
    j->layer_rows = layer_rows; j->row_bytes = row_bytes; j->dim = dim; j->scale_bytes = row_bytes - dim;
    j->rows_per_page = rpp;
    j->crcs = j->crcs_view.buf;
    j->ncrcs = j->crcs_view.len / 4;
    const int64_t pages = (layer_rows + rpp - 1) / rpp;
    if (j->ncrcs < pages) {
        PyErr_Format(PyExc_ValueError, "crcs holds %lld page checksums, the layer has %lld pages",
                     (long long)j->ncrcs, (long long)pages);
        return -1;
    }
    /* max_rows: the most rows whose three page-aligned blocks fit the staging buffer */
    const int64_t per_row = 8 + dim + j->scale_bytes;
    int64_t max_rows = j->staging.len / per_row;
    while (max_rows > 0 && up_to_page(max_rows * 8) + up_to_page(max_rows * dim) +
                               up_to_page(max_rows * j->scale_bytes) > j->staging.len)
        max_rows--;
    if (max_rows <= 0 || max_rows >= ((int64_t)1 << KEY_ROW_BITS) || (uintptr_t)j->staging.buf % PAGE) {
        PyErr_Format(PyExc_ValueError, "staging: a 4 KiB aligned buffer for 1..%lld rows of ids and both blocks "
                     "(%zd bytes gives %lld)", (long long)(((int64_t)1 << KEY_ROW_BITS) - 1), j->staging.len,
                     (long long)max_rows);
        return -1;
    }
    j->max_rows = max_rows;
    uint8_t *base = j->staging.buf;
    j->ids = (int64_t *)base;
    j->weight = base + up_to_page(max_rows * 8);
    j->scales = j->weight + up_to_page(max_rows * dim);
    if (!PyTuple_Check(o_fds) || PyTuple_GET_SIZE(o_fds) < 1 || PyTuple_GET_SIZE(o_fds) > MAX_STRIPES) {
        PyErr_Format(PyExc_ValueError, "stripe_fds: a tuple of 1..%d file descriptors", MAX_STRIPES);
        return -1;
    }
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(o_fds); s++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(o_fds, s));
        if (fd < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "stripe_fds: file descriptors are >= 0");
            return -1;
        }
        j->stripe_fd[s] = (int)fd;
        j->nstripes = (int)s + 1;
    }
    j->qd = qd < 1 ? 1 : qd > MAX_QD ? MAX_QD : qd;
    j->deadline_ns = (int64_t)(deadline * 1e9);
    if (posix_memalign((void **)&j->scratch, PAGE, (size_t)j->qd * PAGE) != 0) j->scratch = NULL;
    j->pos = malloc((size_t)max_rows * 8);
    j->order = malloc((size_t)max_rows * 8);
    j->ext_off = malloc((size_t)max_rows * 8);
    j->ext_len = malloc((size_t)max_rows * 8);
    j->first_row = malloc((size_t)(max_rows + 1) * 8);
    j->row_off = malloc((size_t)max_rows * 8);
    j->bad = malloc((size_t)max_rows * 8);
    if (!j->scratch || !j->pos || !j->order || !j->ext_off || !j->ext_len || !j->first_row || !j->row_off || !j->bad) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&j->lock, NULL);
    pthread_mutex_init(&j->msg_lock, NULL);
    j->lock_ready = 1;
    return 0;
}

static int ready(Job *j) {
    if (!j->lock_ready) PyErr_SetString(PyExc_RuntimeError, "Job is not initialized");
    return j->lock_ready;
}

static fetch_call *call_for(Job *j, long long n) {
    if (n < 0 || n > j->max_rows) {
        PyErr_Format(PyExc_ValueError, "a run takes 0..%lld rows (the staging size), got %lld", (long long)j->max_rows, n);
        return NULL;
    }
    for (int i = 0; i < j->ncalls; i++)
        if (j->calls[i]->rows == n) return j->calls[i];
    if (j->ncalls == j->cap_calls) {
        int cap = j->cap_calls ? 2 * j->cap_calls : 8;
        fetch_call **grown = realloc(j->calls, (size_t)cap * sizeof *grown);
        if (!grown) return (fetch_call *)PyErr_NoMemory();
        j->calls = grown;
        j->cap_calls = cap;
    }
    fetch_call *c = malloc(sizeof *c);
    if (!c) return (fetch_call *)PyErr_NoMemory();
    c->job = j;
    c->rows = n;
    j->calls[j->ncalls++] = c;
    return c;
}

static PyObject *job_call_address(Job *j, PyObject *args) {
    long long n;
    if (!ready(j) || !PyArg_ParseTuple(args, "L", &n)) return NULL;
    fetch_call *c = call_for(j, n);
    return c ? PyLong_FromVoidPtr(c) : NULL;
}

static PyObject *job_run_py(Job *j, PyObject *args) {
    long long n;
    if (!ready(j) || !PyArg_ParseTuple(args, "L", &n)) return NULL;
    fetch_call *c = call_for(j, n);
    if (!c) return NULL;
    Py_BEGIN_ALLOW_THREADS
    engram_fetch_host_fn(c);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *job_run_in_native_thread(Job *j, PyObject *args) {
    long long n;
    if (!ready(j) || !PyArg_ParseTuple(args, "L", &n)) return NULL;
    fetch_call *c = call_for(j, n);
    if (!c) return NULL;
    pthread_t t;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_create(&t, NULL, thread_main, c);
    if (rc == 0) pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *job_launch_host(Job *j, PyObject *args) {
    unsigned long long stream;
    long long n;
    if (!ready(j) || !PyArg_ParseTuple(args, "KL", &stream, &n)) return NULL;
    fetch_call *c = call_for(j, n);
    if (!c) return NULL;
    gpu_launcher gpu;  /* cuLaunchHostFunc or hipLaunchHostFunc, as gpu_runtime.py chose at first use */
    if (gpu_launcher_get(&gpu) < 0) return NULL;
    int rc = gpu.launch((void *)(uintptr_t)stream, engram_fetch_host_fn, c);
    if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "%s failed: %s %d", gpu.name, gpu.result_type, rc);
    Py_RETURN_NONE;
}

static PyObject *job_attach(Job *j, PyObject *args) {
    int fd;
    PyObject *o_region;
    long long ids_off, out_off;
    if (!ready(j) || !PyArg_ParseTuple(args, "iOLL", &fd, &o_region, &ids_off, &out_off)) return NULL;
    Py_buffer region;
    if (PyObject_GetBuffer(o_region, &region, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (ids_off < 0 || out_off < 0 || ids_off % 8 || ids_off + j->max_rows * 8 > region.len ||
        out_off + j->max_rows * j->row_bytes > region.len) {
        PyBuffer_Release(&region);
        return PyErr_Format(PyExc_ValueError, "the region (%zd bytes) must hold %lld ids at %lld and their rows at %lld",
                            region.len, (long long)j->max_rows, ids_off, out_off);
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        PyBuffer_Release(&region);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_buffer old = {0};
    int had = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&j->lock);  /* a run in progress finishes with the old connection first */
    if (j->sock >= 0) close(j->sock);
    had = j->has_region;
    old = j->region;
    j->region = region;
    j->has_region = 1;
    j->sock = fd;
    j->ids_off = ids_off;
    j->out_off = out_off;
    pthread_mutex_unlock(&j->lock);
    Py_END_ALLOW_THREADS
    if (had) PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

static PyObject *job_detach(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    Py_buffer old = {0};
    int had;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&j->lock);
    if (j->sock >= 0) close(j->sock);
    j->sock = -1;
    had = j->has_region;
    old = j->region;
    j->has_region = 0;
    pthread_mutex_unlock(&j->lock);
    Py_END_ALLOW_THREADS
    if (had) PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

/* Between steps nothing is due from the daemon: a connection that reads as ready then was closed by it (its
   idle timeout, a restart) or is out of step. Dropping it now lets the reconnect come before the next step
   instead of that step finding it closed (and reading its pages directly). Never waits behind a run. */
static PyObject *job_probe(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    int dropped = 0;
    if (pthread_mutex_trylock(&j->lock) == 0) {
        if (j->sock >= 0) {
            struct pollfd p = {.fd = j->sock, .events = POLLIN};
            if (poll(&p, 1, 0) > 0) {
                char byte;
                const ssize_t r = recv(j->sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
                drop(j, r == 0 || (p.revents & (POLLHUP | POLLERR)) ? "the daemon closed it between steps"
                                                                     : "bytes nobody asked for between steps");
                dropped = 1;
            }
        }
        pthread_mutex_unlock(&j->lock);
    }
    return PyBool_FromLong(dropped);
}

static PyObject *job_connected(Job *j, void *closure) {
    return PyBool_FromLong(j->lock_ready && __atomic_load_n(&j->sock, __ATOMIC_RELAXED) >= 0);
}

static PyObject *job_max_rows(Job *j, void *closure) { return PyLong_FromLongLong(j->max_rows); }

static PyObject *job_offsets(Job *j, void *closure) {
    /* byte offsets in staging of the ids, the payload block and the scale block */
    return Py_BuildValue("(LLL)", 0LL, (long long)((uint8_t *)j->weight - (uint8_t *)j->ids),
                         (long long)((uint8_t *)j->scales - (uint8_t *)j->ids));
}

static PyObject *job_stats(Job *j, PyObject *noargs) {
    char note[MSG_BYTES];
    pthread_mutex_lock(&j->msg_lock);
    memcpy(note, j->note, MSG_BYTES);
    pthread_mutex_unlock(&j->msg_lock);
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsdsdsdss}", "steps", (long long)j->steps, "rows", (long long)j->rows,
        "daemon_steps", (long long)j->daemon_steps, "direct_steps", (long long)j->direct_steps,
        "direct_pages", (long long)j->direct_pages, "daemon_errors", (long long)j->daemon_errors,
        "drops", (long long)j->drops, "failed_steps", (long long)j->failed_steps, "bad_pages", (long long)j->bad_pages,
        "last_seconds", j->last_ns / 1e9, "max_seconds", j->max_ns / 1e9, "total_seconds", j->total_ns / 1e9,
        "note", note);
}

static PyObject *job_error(Job *j, PyObject *noargs) {
    /* ("corrupt" | "io" | "", message, (pages...)) */
    char msg[MSG_BYTES];
    int64_t pages[SHOWN];
    int kind, npages;
    pthread_mutex_lock(&j->msg_lock);
    memcpy(msg, j->error, MSG_BYTES);
    kind = msg[0] ? j->error_kind : ERR_NONE;
    npages = j->error_npages;
    memcpy(pages, j->error_pages, sizeof pages);
    pthread_mutex_unlock(&j->msg_lock);
    PyObject *tuple = PyTuple_New(kind == ERR_CORRUPT ? npages : 0);
    for (int i = 0; tuple && kind == ERR_CORRUPT && i < npages; i++)
        PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(pages[i]));
    if (!tuple) return NULL;
    return Py_BuildValue("(sNN)", kind == ERR_CORRUPT ? "corrupt" : kind == ERR_IO ? "io" : "",
                         PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace"), tuple);
}

static PyObject *job_clear_error(Job *j, PyObject *noargs) {
    pthread_mutex_lock(&j->msg_lock);
    j->error[0] = 0;
    pthread_mutex_unlock(&j->msg_lock);
    Py_RETURN_NONE;
}

static PyObject *run_address(PyObject *self, void *closure) { return PyLong_FromVoidPtr((void *)engram_fetch_host_fn); }

static PyMethodDef job_methods[] = {
    {"run", (PyCFunction)job_run_py, METH_VARARGS, "run(n): fetch rows 0..n-1 of staging now (the GIL released)"},
    {"run_in_native_thread", (PyCFunction)job_run_in_native_thread, METH_VARARGS,
     "run_in_native_thread(n): the same, called from a pthread that never held the GIL, joined"},
    {"launch_host", (PyCFunction)job_launch_host, METH_VARARGS,
     "launch_host(stream, n): cuLaunchHostFunc / hipLaunchHostFunc(stream, run function, call_address(n)); captured "
     "by CUDA and HIP graphs"},
    {"call_address", (PyCFunction)job_call_address, METH_VARARGS,
     "call_address(n) -> the run function's argument for n rows (stable for the job's life)"},
    {"attach", (PyCFunction)job_attach, METH_VARARGS,
     "attach(fd, region, ids_offset, out_offset): take a daemon connection (the job closes fd)"},
    {"detach", (PyCFunction)job_detach, METH_NOARGS, "detach(): close the daemon connection"},
    {"probe", (PyCFunction)job_probe, METH_NOARGS,
     "probe() -> True when it dropped a connection the daemon closed between steps (never waits behind a run)"},
    {"stats", (PyCFunction)job_stats, METH_NOARGS, "stats() -> dict of counters and the last fallback's reason"},
    {"error", (PyCFunction)job_error, METH_NOARGS,
     "error() -> (kind, message, pages) of the first unreported failure: kind 'corrupt' (pages: the first bad "
     "ones), 'io', or '' (none)"},
    {"clear_error", (PyCFunction)job_clear_error, METH_NOARGS, "clear_error(): the failure is reported"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"connected", (getter)job_connected, NULL, "whether the job has a daemon connection", NULL},
    {"max_rows", (getter)job_max_rows, NULL, "rows one run takes at most (from the staging size)", NULL},
    {"offsets", (getter)job_offsets, NULL, "(ids, payload block, scale block) byte offsets in staging", NULL},
    {"run_address", (getter)run_address, NULL, "address of void engram_fetch_host_fn(void *call)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engram_store.native._fetch.Job",
    .tp_basicsize = sizeof(Job),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One cached layer's fetch job; see the module docstring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)job_init,
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

static PyObject *staging_bytes(PyObject *self, PyObject *args) {
    long long rows, dim, scale_bytes;
    if (!PyArg_ParseTuple(args, "LLL", &rows, &dim, &scale_bytes)) return NULL;
    return PyLong_FromLongLong(up_to_page(rows * 8) + up_to_page(rows * dim) + up_to_page(rows * scale_bytes));
}

static PyMethodDef module_methods[] = {
    {"staging_bytes", staging_bytes, METH_VARARGS,
     "staging_bytes(rows, dim, scale_bytes) -> bytes of a staging buffer for that many rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fetch", "The engines' fetch job for cached Engram layers.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fetch(void) {
    pthread_atfork(NULL, NULL, reset_pool_in_child);
    crc_init();
    if (PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&JobType);
    if (PyModule_AddObject(m, "Job", (PyObject *)&JobType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ROWS", ((int64_t)1 << KEY_ROW_BITS) - 1) < 0 ||
        PyModule_AddObject(m, "FRAME_FIELDS", frame_fields()) < 0) {
        Py_DECREF(&JobType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
