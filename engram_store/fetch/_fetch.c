/* The engines' fetch job: one step's Engram rows of one cached layer, fetched by native code that a
 * CUDA host function can run (no GIL, no CUDA call, no Python).
 *
 * Checksums(crcs)
 *     A layer's page checksums (uint32 per page, in layer page order) copied into private memory,
 *     shared by the jobs given the same object (never a mapping of the .crc file).
 * Job(layer, layer_rows, row_bytes, dim, rows_per_page, staging, checksums, files, queue_depth,
 *     deadline_seconds, hedge_seconds=0, gate=None, budget=-1)
 *     `staging` is a writable buffer the job uses for its life (the caller registers it with the GPU):
 *     int64 ids [max_rows], then the payload block uint8 [max_rows, dim], then the scale block
 *     uint8 [max_rows, row_bytes - dim] (empty for rows without block scales: FP8 with one table
 *     scale, BF16), each starting on a 4 KiB boundary (max_rows is derived
 *     from the buffer's size). Row i of the blocks is the row of ids[i]: the engines' kernels read
 *     the blocks as `weight` / `weight_scale_inv` with positional ids. `files` is a tuple of
 *     (fd, path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): the layer's data file (or its
 *     K stripes, opened O_DIRECT), then its checksum file, as the caller checked them (the job takes
 *     the fds and closes them). hedge_seconds > 0 fixes the hedge budget (below); 0 measures it.
 *     `gate`: the staging memfd's gate word (4 writable bytes, engram_store/wire/staging.py), needed
 *     for connections whose daemon writes the rows into the staging itself (attach(..., split=True)).
 *     `budget`: an fd (the job keeps a dup) of the node's budget file of direct pages in flight
 *     (direct_budget.h, fetch/budget.py); -1: direct reads unbounded.
 *
 * engram_fetch_host_fn(void *call) is the run function: `call` (call_address(n)) names the job and
 * the row count n of one step (a captured CUDA graph bakes the pointer in, so there is one call per
 * count, kept as long as a graph may run it: see core.h). Every step ends within the deadline:
 *   1. rows whose id is outside [0, layer_rows) are zeroed (padding: the engines' kernels read zeros
 *      for ids they do not own); the others are taken;
 *   2. when connected to the daemon (attach()), their ids go into the connection's shared region
 *      with one LOOKUP (daemon.h); its rows are copied into the two blocks when it answers,
 *      or, when the daemon took the staging (split), written there by the daemon (one host copy,
 *      under the staging's gate: run.h);
 *   3. when the daemon has not answered within the hedge budget (a few times its measured p99),
 *      the job also reads the rows directly: its reader thread (reader.h) reads their 4 KiB
 *      pages from the table files (Linux AIO, queue_depth in flight), checks each against its crc32c
 *      and packs the rows in its own buffers. The first source complete wins, once: the loser's rows
 *      never reach the staging (a late daemon answer is read and dropped before the next request;
 *      one a deadline late drops the connection). With no daemon (gone, dropped, answering an error,
 *      still busy with a request a step gave up on, or backed off after missing its budget again and
 *      again), the rows are read directly at once. Direct reads of all jobs on the node share one
 *      budget of pages in flight (direct_budget.h): with none of it free, a step waits for the daemon
 *      (asked even while backing off) or for the budget, to its deadline, instead of reading;
 *   4. nothing complete by the deadline (a stuck device, a stopped daemon with direct reads stuck):
 *      the rows are zero and the failure is recorded; the reader keeps its buffers until its read
 *      ends, and direct reads fail at once meanwhile. A page failing its check, a read error, or a
 *      table file changed since it was opened likewise leave rows zero and are recorded. error()
 *      then names layer, rows and pages or files, and the engine raises at its next host-visible point.
 *   One run at a time (a mutex); the status of each run is kept (stats(), error()). A daemon that
 *   failed at the transport is dropped: connected is false until attach() gives the job a new
 *   connection (the Python side reconnects in the background).
 *
 * Python: run(n) (the GIL released), run_in_native_thread(n) (a pthread of its own: proof that no
 * GIL is needed), launch_host(stream, n) (cuLaunchHostFunc or hipLaunchHostFunc, whichever GPU runtime
 * torch runs on: native/gpu_runtime/host_launch.h; the job needs neither at build time), run_address /
 * call_address(n), attach(fd, region, ids_offset, out_offset, split=False), detach(), probe(), close(),
 * connected, stats(), error(), clear_error(). Module: staging_bytes(), live_cores(), late_calls(), and for
 * tests test_hooks(hold_reads=..., without_pidfds=...) (native/common/test_hooks.h: a stuck device; no
 * pidfd of the daemon, writer.h's other way).
 *
 * The parts, one unit each (a header of prototypes beside each): core.c (the shared state: the bottom
 * unit), lifecycle.c (the core's close and its last reference's frees), direct_budget.c (the node's budget of direct pages), reader.c (the reader thread),
 * daemon.c (the daemon exchange), writer.c (whether a daemon writing into the staging is gone),
 * board.c (the failure board), run.c (the run function); this file is the Python module: the Checksums
 * and Job types and their checks of every argument, long because Job has a score of methods and checks
 * each buffer and file it is handed (the work itself is in the units).
 */
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
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define CTX_POOL 8 /* idle AIO contexts kept (aio.h) */

#include "crc32c.h"         /* PAGE, crc_init */
#include "aio.h"            /* aio_init */
#include "frame.h"          /* FLAG_SPLIT, SPLIT_PAD_ID, frame_fields() */
#include "staging_gate.h"   /* the staging's gate: one host copy (wire/staging.py) */
#include "test_hooks.h"     /* TEST_HOOKS_METHOD: the fault hooks tests turn on */
#include "host_launch.h"    /* gpu_launcher_get: the host-function launch of the GPU runtime torch runs on */
#include "core.h"           /* core_t, fetch_call, the lifetime rules */
#include "lifecycle.h"      /* core_close, core_release: the Job's close and its reference */
#include "direct_budget.h"  /* the node's budget of direct pages in flight */
#include "reader.h"         /* the reader thread: direct reads, file checks */
#include "daemon.h"         /* the daemon exchange, the hedge budget, the back-off */
#include "writer.h"         /* whether a daemon writing into the staging is gone (pidfd, or its connection) */
#include "board.h"          /* the failure board every rank of a server shares */
#include "run.h"            /* the run function: one step within its deadline */

/* --- Python: Checksums --------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    crc_blob *blob;
    PyObject *weakrefs;
} Checksums;

static int checksums_init(Checksums *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"crcs", NULL};
    Py_buffer v;
    if (self->blob) {
        PyErr_SetString(PyExc_RuntimeError, "Checksums is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*", names, &v)) return -1;
    if (v.len % 4 || (v.itemsize != 4 && v.itemsize != 1)) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_TypeError, "crcs must be a uint32 buffer");
        return -1;
    }
    crc_blob *b = malloc(sizeof *b + (size_t)v.len);
    if (!b) {
        PyBuffer_Release(&v);
        PyErr_NoMemory();
        return -1;
    }
    atomic_init(&b->refs, 1);
    b->n = v.len / 4;
    memcpy(b->crc, v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    self->blob = b;
    return 0;
}

static void checksums_dealloc(Checksums *self) {
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    crc_blob_release(self->blob);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t checksums_len(Checksums *self) { return self->blob ? (Py_ssize_t)self->blob->n : 0; }

static PySequenceMethods checksums_seq = {.sq_length = (lenfunc)checksums_len};

static PyTypeObject ChecksumsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engram_store.fetch._fetch.Checksums",
    .tp_basicsize = sizeof(Checksums),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Checksums(crcs): a layer's page checksums copied into private memory (len: pages)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)checksums_init,
    .tp_dealloc = (destructor)checksums_dealloc,
    .tp_weaklistoffset = offsetof(Checksums, weakrefs),
    .tp_as_sequence = &checksums_seq,
};

/* --- Python: Job --------------------------------------------------------------------------------- */
typedef struct Job {
    PyObject_HEAD
    core_t *core;
    int ready;
    Py_buffer staging, region, board, gate;
    int has_region, has_board, has_gate;
} Job;

static int64_t up_to_page(int64_t x) { return (x + PAGE - 1) / PAGE * PAGE; }

static void job_dealloc(Job *j) {
    core_t *c = j->core;
    if (c) {
        Py_BEGIN_ALLOW_THREADS
        core_close(c);
        Py_END_ALLOW_THREADS
    }
    if (j->has_region) PyBuffer_Release(&j->region);
    if (j->has_board) PyBuffer_Release(&j->board);
    if (j->has_gate) PyBuffer_Release(&j->gate);
    if (j->staging.obj) PyBuffer_Release(&j->staging);
    if (c) core_release(c);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

/* files: ((fd, path, dev, ino, size, mtime_ns, ctime_ns), ...): the stripes, then the checksum file. */
static int take_files(core_t *c, PyObject *files) {
    reader_t *r = &c->rd;
    const Py_ssize_t n = PyTuple_Check(files) ? PyTuple_GET_SIZE(files) : 0;
    if (n < 2 || n > MAX_STRIPES + 1) {
        PyErr_Format(PyExc_ValueError, "files: a tuple of the data file (or 1..%d stripes) and the checksum file",
                     MAX_STRIPES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int fd;
        const char *path;
        long long dev, ino, size, mtime, ctime;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(files, i), "isLLLLL", &fd, &path, &dev, &ino, &size, &mtime, &ctime))
            return -1;
        watched_t *w = &r->watch[r->nwatch];
        *w = (watched_t){.fd = fd, .path = strdup(path), .dev = dev, .ino = ino, .size = size, .mtime_ns = mtime,
                         .ctime_ns = ctime};
        r->nwatch++;  /* the job's now: closed with it */
        if (!w->path) {
            PyErr_NoMemory();
            return -1;
        }
    }
    r->nstripes = (int)n - 1;
    return 0;
}

static int job_init(Job *j, PyObject *args, PyObject *kw) {
    static char *names[] = {"layer", "layer_rows", "row_bytes", "dim", "rows_per_page", "staging", "checksums",
                            "files", "queue_depth", "deadline_seconds", "hedge_seconds", "gate", "budget", NULL};
    int layer, qd, budget = -1;
    long long layer_rows, row_bytes, dim, rpp;
    double deadline, hedge = 0;
    PyObject *o_staging, *o_files, *o_gate = Py_None;
    Checksums *sums;
    if (j->core) {
        PyErr_SetString(PyExc_RuntimeError, "Job is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLLLLOO!Oid|dOi", names, &layer, &layer_rows, &row_bytes, &dim, &rpp,
                                     &o_staging, &ChecksumsType, &sums, &o_files, &qd, &deadline, &hedge, &o_gate,
                                     &budget))
        return -1;
    core_t *c = j->core = calloc(1, sizeof *c);
    if (!c) {
        PyErr_NoMemory();
        return -1;
    }
    atomic_init(&c->refs, 1);
    atomic_fetch_add(&live_cores, 1);
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->msg_lock, NULL);
    c->sock = -1;
    c->rd.efd = -1;
    c->peer_pidfd = -1;
    c->stuck = (writer_t){.pidfd = -1, .sock = -1};
    c->budget_fd = -1;
    c->budget_next = (uint32_t)getpid() * 2654435761u + (uint32_t)layer * 40503u;  /* jobs start apart */
    if (budget >= 0) {  /* a dup: the caller closes its fd; the locks go with the open file description */
        const int fd = fcntl(budget, F_DUPFD_CLOEXEC, 0);
        if (fd < 0 || budget_map(c, fd) < 0) {
            if (fd >= 0) close(fd);
            PyErr_SetString(PyExc_ValueError, "budget: the fd of a direct-read budget file (fetch/budget.py)");
            return -1;
        }
    }
    c->backoff_ns = BACKOFF_MIN_NS;
    if (take_files(c, o_files) < 0) return -1;
    if (!sums->blob) {
        PyErr_SetString(PyExc_ValueError, "checksums: an initialized Checksums");
        return -1;
    }
    atomic_fetch_add(&sums->blob->refs, 1);
    c->rd.crcs = sums->blob;
    if (layer_rows <= 0 || dim <= 0 || row_bytes < dim || rpp <= 0 || rpp * row_bytes > PAGE || !(deadline > 0) ||
        hedge < 0) {
        PyErr_SetString(PyExc_ValueError, "Job: layer_rows, dim > 0; row_bytes >= dim; rows_per_page * row_bytes "
                                          "<= 4096; deadline_seconds > 0; hedge_seconds >= 0");
        return -1;
    }
    if (PyObject_GetBuffer(o_staging, &j->staging, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (o_gate != Py_None) {
        if (PyObject_GetBuffer(o_gate, &j->gate, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
        j->has_gate = 1;
        if (j->gate.len < 4 || (uintptr_t)j->gate.buf % 4) {
            PyErr_SetString(PyExc_ValueError, "gate: 4 writable bytes, 4-byte aligned (the staging memfd's gate word)");
            return -1;
        }
        c->gate = j->gate.buf;
    }
    c->layer = layer;
    c->layer_rows = layer_rows; c->row_bytes = row_bytes; c->dim = dim; c->scale_bytes = row_bytes - dim;
    c->rows_per_page = rpp;
    const int64_t pages = (layer_rows + rpp - 1) / rpp;
    if (c->rd.crcs->n < pages) {
        PyErr_Format(PyExc_ValueError, "checksums holds %lld page checksums, the layer has %lld pages",
                     (long long)c->rd.crcs->n, (long long)pages);
        return -1;
    }
    /* max_rows: the most rows whose three page-aligned blocks fit the staging buffer */
    const int64_t per_row = 8 + dim + c->scale_bytes;
    int64_t max_rows = j->staging.len / per_row;
    while (max_rows > 0 && up_to_page(max_rows * 8) + up_to_page(max_rows * dim) +
                               up_to_page(max_rows * c->scale_bytes) > j->staging.len)
        max_rows--;
    if (max_rows <= 0 || max_rows >= ((int64_t)1 << KEY_ROW_BITS) || (uintptr_t)j->staging.buf % PAGE) {
        PyErr_Format(PyExc_ValueError, "staging: a 4 KiB aligned buffer for 1..%lld rows of ids and both blocks "
                     "(%zd bytes gives %lld)", (long long)(((int64_t)1 << KEY_ROW_BITS) - 1), j->staging.len,
                     (long long)max_rows);
        return -1;
    }
    c->max_rows = max_rows;
    uint8_t *base = j->staging.buf;
    c->ids = (int64_t *)base;
    c->weight = base + up_to_page(max_rows * 8);
    c->scales = c->weight + up_to_page(max_rows * dim);
    c->deadline_ns = (int64_t)(deadline * 1e9);
    c->hedge_fixed_ns = (int64_t)(hedge * 1e9);
    c->pos = malloc((size_t)max_rows * 8);
    c->call_nchunks = max_rows / CALL_CHUNK + 1;  /* row counts 0..max_rows */
    c->call_chunks = calloc((size_t)c->call_nchunks, sizeof *c->call_chunks);
    if (!c->pos || !c->call_chunks || reader_init(c, qd < 1 ? 1 : qd > AIO_MAX_QD ? AIO_MAX_QD : qd, core_release) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    j->ready = 1;
    return 0;
}

static int ready(Job *j) {
    if (!j->ready) PyErr_SetString(PyExc_RuntimeError, "Job is not initialized");
    return j->ready;
}

static int rows_ok(Job *j, long long n) {
    if (n >= 0 && n <= j->core->max_rows) return 1;
    PyErr_Format(PyExc_ValueError, "a run takes 0..%lld rows (the staging size), got %lld", (long long)j->core->max_rows, n);
    return 0;
}

/* The call record for n rows, kept for the core's life: O(1), its chunk made on first use (core.h).
   Under the GIL (call_address, launch_host). */
static fetch_call *call_record(Job *j, long long n) {
    core_t *core = j->core;
    if (!rows_ok(j, n)) return NULL;
    fetch_call **chunk = &core->call_chunks[n / CALL_CHUNK];
    if (*chunk == NULL) {
        fetch_call *made = malloc(CALL_CHUNK * sizeof *made);
        if (!made) return (fetch_call *)PyErr_NoMemory();
        const int64_t first = n / CALL_CHUNK * CALL_CHUNK;
        for (int i = 0; i < CALL_CHUNK; i++) made[i] = (fetch_call){.core = core, .rows = first + i};
        *chunk = made;
        core->call_used++;
    }
    return &(*chunk)[n % CALL_CHUNK];
}

/* A call record handed out (call_address, launch_host): a captured graph may run it any time after,
   so the core's shell outlives the Job (core.h). */
static fetch_call *call_for(Job *j, long long n) {
    fetch_call *c = call_record(j, n);
    if (c) __atomic_store_n(&j->core->exposed, 1, __ATOMIC_RELEASE);
    return c;
}

static int open_for_runs(Job *j) {
    if (!ready(j)) return 0;
    if (__atomic_load_n(&j->core->closed, __ATOMIC_RELAXED)) {
        PyErr_SetString(PyExc_ValueError, "the fetch job is closed");
        return 0;
    }
    return 1;
}

static PyObject *job_call_address(Job *j, PyObject *args) {
    long long n;
    if (!ready(j) || !PyArg_ParseTuple(args, "L", &n)) return NULL;
    fetch_call *c = call_for(j, n);
    return c ? PyLong_FromVoidPtr(c) : NULL;
}

static PyObject *job_run_py(Job *j, PyObject *args) {
    long long n;
    if (!open_for_runs(j) || !PyArg_ParseTuple(args, "L", &n) || !rows_ok(j, n)) return NULL;
    fetch_call call = {.core = j->core, .rows = n};  /* a run of its own: no record kept */
    Py_BEGIN_ALLOW_THREADS
    engram_fetch_host_fn(&call);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *job_run_in_native_thread(Job *j, PyObject *args) {
    long long n;
    if (!open_for_runs(j) || !PyArg_ParseTuple(args, "L", &n) || !rows_ok(j, n)) return NULL;
    fetch_call call = {.core = j->core, .rows = n};  /* joined below: no record kept */
    pthread_t t;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_create(&t, NULL, run_in_thread, &call);
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
    int fd, split = 0;
    PyObject *o_region;
    long long ids_off, out_off;
    if (!open_for_runs(j) || !PyArg_ParseTuple(args, "iOLL|p", &fd, &o_region, &ids_off, &out_off, &split))
        return NULL;
    core_t *c = j->core;
    if (split && c->gate == NULL)
        return PyErr_Format(PyExc_ValueError, "attach(split=True): the job was made without a staging gate");
    Py_buffer region;
    if (PyObject_GetBuffer(o_region, &region, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (ids_off < 0 || out_off < 0 || ids_off % 8 || ids_off + c->max_rows * 8 > region.len ||
        out_off + c->max_rows * c->row_bytes > region.len) {
        PyBuffer_Release(&region);
        return PyErr_Format(PyExc_ValueError, "the region (%zd bytes) must hold %lld ids at %lld and their rows at %lld",
                            region.len, (long long)c->max_rows, ids_off, out_off);
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        PyBuffer_Release(&region);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    const int pidfd = peer_pidfd(fd);
    Py_buffer old = {0};
    int had = 0, closed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);  /* a run in progress finishes with the old connection first */
    closed = c->closed;
    if (!closed) {
        if (c->sock >= 0) close(c->sock);
        had = j->has_region;
        old = j->region;
        j->region = region;
        j->has_region = 1;
        c->sock = fd;
        c->region = region.buf;
        c->region_len = region.len;
        c->ids_off = ids_off;
        c->out_off = out_off;
        c->pending_id = 0;
        c->split = split;
        if (c->peer_pidfd >= 0) close(c->peer_pidfd);
        c->peer_pidfd = pidfd;
        c->peer_hup_ns = 0;
    }
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (closed) {
        if (pidfd >= 0) close(pidfd);
        close(fd);
        PyBuffer_Release(&region);
        PyErr_SetString(PyExc_ValueError, "the fetch job is closed");
        return NULL;
    }
    if (had) PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

static PyObject *job_detach(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    core_t *c = j->core;
    Py_buffer old = {0};
    int had;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
    c->region = NULL;
    c->region_len = 0;
    c->pending_id = 0;
    c->split = 0;
    had = j->has_region;
    old = j->region;
    j->has_region = 0;
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (had) PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

static PyObject *job_close(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    core_close(j->core);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Between steps nothing is due from the daemon, but the late answer of a request a step gave up on: that
   is read and dropped; a connection that reads as ready otherwise was closed by the daemon (its idle
   timeout, a restart) or is out of step. Dropping it now lets the reconnect come before the next step
   instead of that step finding it closed (and reading its pages directly). Never waits behind a run. */
static PyObject *job_probe(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    core_t *c = j->core;
    int dropped = 0;
    if (pthread_mutex_trylock(&c->lock) == 0) {
        if (c->sock >= 0 && c->pending_id) {
            settle_pending(c, now_ns());
            dropped = c->sock < 0;
        } else if (c->sock >= 0) {
            struct pollfd p = {.fd = c->sock, .events = POLLIN};
            if (poll(&p, 1, 0) > 0) {
                char byte;
                const ssize_t r = recv(c->sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
                daemon_drop(c, r == 0 || (p.revents & (POLLHUP | POLLERR)) ? "the daemon closed it between steps"
                                                                     : "bytes nobody asked for between steps");
                dropped = 1;
            }
        }
        pthread_mutex_unlock(&c->lock);
    }
    return PyBool_FromLong(dropped);
}

static PyObject *job_connected(Job *j, void *closure) {
    return PyBool_FromLong(j->ready && __atomic_load_n(&j->core->sock, __ATOMIC_RELAXED) >= 0);
}

static PyObject *job_max_rows(Job *j, void *closure) { return PyLong_FromLongLong(j->ready ? j->core->max_rows : 0); }

static PyObject *job_offsets(Job *j, void *closure) {
    /* byte offsets in staging of the ids, the payload block and the scale block */
    if (!ready(j)) return NULL;
    const core_t *c = j->core;
    return Py_BuildValue("(LLL)", 0LL, (long long)((uint8_t *)c->weight - (uint8_t *)c->ids),
                         (long long)((uint8_t *)c->scales - (uint8_t *)c->ids));
}

static PyObject *job_stats(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    core_t *c = j->core;
    char note[MSG_BYTES];
    pthread_mutex_lock(&c->msg_lock);
    memcpy(note, c->note, MSG_BYTES);
    pthread_mutex_unlock(&c->msg_lock);
    const double stuck = reader_stuck_seconds(c);
    PyObject *pending = PyBool_FromLong(__atomic_load_n(&c->pending_id, __ATOMIC_RELAXED) != 0);
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsdsdsdsdsdsNsNsNsNss}", "steps", (long long)c->steps, "rows", (long long)c->rows,
        "daemon_steps", (long long)c->daemon_steps, "direct_steps", (long long)c->direct_steps,
        "direct_pages", (long long)c->direct_pages, "daemon_errors", (long long)c->daemon_errors,
        "drops", (long long)c->drops, "failed_steps", (long long)c->failed_steps, "bad_pages", (long long)c->bad_pages,
        "hedged_steps", (long long)c->hedged_steps, "busy_steps", (long long)c->busy_steps,
        "backoff_steps", (long long)c->backoff_steps, "late_answers", (long long)c->late_answers,
        "timeouts", (long long)c->timeouts, "stuck_steps", (long long)c->stuck_steps,
        "one_copy_steps", (long long)c->one_copy_steps, "copied_rows", (long long)c->copied_rows,
        "gate_waits", (long long)c->gate_waits, "dead_writers", (long long)c->dead_writers,
        "call_records", (long long)c->call_used * CALL_CHUNK,
        "hedged_direct_steps", (long long)c->hedged_direct_steps, "fallback_direct_steps",
        (long long)c->fallback_direct_steps, "waited_steps", (long long)c->waited_steps,
        "budget_refusals", (long long)c->budget_refusals, "direct_budget_pages", (long long)budget_pages(c),
        "last_seconds", c->last_ns / 1e9, "max_seconds", c->max_ns / 1e9, "total_seconds", c->total_ns / 1e9,
        "hedge_seconds", c->hedge_ns / 1e9, "direct_stuck_seconds", stuck, "daemon_pending", pending,
        "one_copy", PyBool_FromLong(__atomic_load_n(&c->split, __ATOMIC_RELAXED)),
        "gate_stuck", PyBool_FromLong(__atomic_load_n(&c->gate_stuck, __ATOMIC_RELAXED) != 0),
        "daemon_pidfd", PyBool_FromLong(__atomic_load_n(&c->peer_pidfd, __ATOMIC_RELAXED) >= 0), "note", note);
}

static PyObject *job_error(Job *j, PyObject *noargs) {
    /* ("corrupt" | "io" | "", message, (pages...)) */
    if (!ready(j)) return NULL;
    core_t *c = j->core;
    char msg[MSG_BYTES];
    int64_t pages[SHOWN];
    int kind, npages;
    pthread_mutex_lock(&c->msg_lock);
    memcpy(msg, c->error, MSG_BYTES);
    kind = msg[0] ? c->error_kind : ERR_NONE;
    npages = c->error_npages;
    memcpy(pages, c->error_pages, sizeof pages);
    pthread_mutex_unlock(&c->msg_lock);
    PyObject *tuple = PyTuple_New(kind == ERR_CORRUPT ? npages : 0);
    for (int i = 0; tuple && kind == ERR_CORRUPT && i < npages; i++)
        PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(pages[i]));
    if (!tuple) return NULL;
    return Py_BuildValue("(sNN)", kind == ERR_CORRUPT ? "corrupt" : kind == ERR_IO ? "io" : "",
                         PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace"), tuple);
}

static PyObject *job_clear_error(Job *j, PyObject *noargs) {
    if (!ready(j)) return NULL;
    pthread_mutex_lock(&j->core->msg_lock);
    j->core->error[0] = 0;
    pthread_mutex_unlock(&j->core->msg_lock);
    Py_RETURN_NONE;
}

static PyObject *run_address(PyObject *self, void *closure) { return PyLong_FromVoidPtr((void *)engram_fetch_host_fn); }

static PyObject *job_set_board(Job *j, PyObject *args) {
    PyObject *o;
    if (!j->core || !PyArg_ParseTuple(args, "O", &o)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "Job is not initialized");
        return NULL;
    }
    Py_buffer board;
    if (PyObject_GetBuffer(o, &board, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (board.len < BOARD_BYTES || (uintptr_t)board.buf % 8) {
        PyBuffer_Release(&board);
        return PyErr_Format(PyExc_ValueError, "a failure board is a writable, 8-byte aligned buffer of %d bytes",
                            BOARD_BYTES);
    }
    core_t *c = j->core;
    Py_buffer old = {0};
    int had;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    if (!c->closed) c->board = board.buf;
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    had = j->has_board;
    old = j->board;
    j->board = board;
    j->has_board = 1;
    if (had) PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

static PyMethodDef job_methods[] = {
    {"set_board", (PyCFunction)job_set_board, METH_VARARGS,
     "set_board(buffer): the failure board (4 KiB, shared by the server's ranks) a failed run writes to"},
    {"run", (PyCFunction)job_run_py, METH_VARARGS, "run(n): fetch rows 0..n-1 of staging now (the GIL released)"},
    {"run_in_native_thread", (PyCFunction)job_run_in_native_thread, METH_VARARGS,
     "run_in_native_thread(n): the same, called from a pthread that never held the GIL, joined"},
    {"launch_host", (PyCFunction)job_launch_host, METH_VARARGS,
     "launch_host(stream, n): cuLaunchHostFunc / hipLaunchHostFunc(stream, run function, call_address(n)); captured "
     "by CUDA and HIP graphs"},
    {"call_address", (PyCFunction)job_call_address, METH_VARARGS,
     "call_address(n) -> the run function's argument for n rows (stable for as long as a graph may run it)"},
    {"attach", (PyCFunction)job_attach, METH_VARARGS,
     "attach(fd, region, ids_offset, out_offset, split=False): take a daemon connection (the job closes fd); split: "
     "its daemon took the staging memfd and writes the rows there itself (one host copy)"},
    {"detach", (PyCFunction)job_detach, METH_NOARGS, "detach(): close the daemon connection"},
    {"close", (PyCFunction)job_close, METH_NOARGS,
     "close(): after a run in progress ends (within its deadline), no run touches the staging again"},
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engram_store.fetch._fetch.Job",
    .tp_basicsize = sizeof(Job),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One cached layer's fetch job; see the module docstring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)job_init,
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

/* --- the module ---------------------------------------------------------------------------------- */
static PyObject *staging_bytes(PyObject *self, PyObject *args) {
    long long rows, dim, scale_bytes;
    if (!PyArg_ParseTuple(args, "LLL", &rows, &dim, &scale_bytes)) return NULL;
    return PyLong_FromLongLong(up_to_page(rows * 8) + up_to_page(rows * dim) + up_to_page(rows * scale_bytes));
}

static PyObject *py_live_cores(PyObject *self, PyObject *noargs) { return PyLong_FromLongLong(atomic_load(&live_cores)); }

static PyObject *py_late_calls(PyObject *self, PyObject *noargs) { return PyLong_FromLongLong(atomic_load(&late_calls)); }

static PyMethodDef module_methods[] = {
    {"staging_bytes", staging_bytes, METH_VARARGS,
     "staging_bytes(rows, dim, scale_bytes) -> bytes of a staging buffer for that many rows"},
    TEST_HOOKS_METHOD,
    {"live_cores", py_live_cores, METH_NOARGS, "live_cores() -> jobs whose buffers and files are not freed yet"},
    {"late_calls", py_late_calls, METH_NOARGS, "late_calls() -> runs that found their job closed and returned"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fetch", "The engines' fetch job for cached Engram layers.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fetch(void) {
    aio_init(CTX_POOL);
    crc_init();
    if (PyType_Ready(&JobType) < 0 || PyType_Ready(&ChecksumsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&JobType);
    Py_INCREF(&ChecksumsType);
    if (PyModule_AddObject(m, "Job", (PyObject *)&JobType) < 0 ||
        PyModule_AddObject(m, "Checksums", (PyObject *)&ChecksumsType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_ROWS", ((int64_t)1 << KEY_ROW_BITS) - 1) < 0 ||
        PyModule_AddObject(m, "FRAME_FIELDS", frame_fields()) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_SPLIT", FLAG_SPLIT) < 0 ||
        PyModule_AddIntConstant(m, "SPLIT_PAD_ID", SPLIT_PAD_ID) < 0 ||
        PyModule_AddObject(m, "GATE_STATES", Py_BuildValue("(iiii)", GATE_REVOKED, GATE_OPEN, GATE_WRITING,
                                                           GATE_DONE)) < 0 ||
        PyModule_AddObject(m, "BUDGET_OFFSETS", Py_BuildValue(
            "{sisisisisisisisisisisisi}", "magic", BUDGET_MAGIC_AT, "version", BUDGET_VERSION_AT, "granules",
            BUDGET_GRANULES_AT, "granule_pages", BUDGET_GRANULE_AT, "reserved", BUDGET_RESERVED_AT, "reserved_max",
            BUDGET_MAX_AT, "refused", BUDGET_REFUSED_AT, "locks", BUDGET_LOCKS, "magic_value", (int)BUDGET_MAGIC,
            "version_value", BUDGET_VERSION, "held", BUDGET_HELD_AT, "file_bytes", BUDGET_FILE_BYTES)) < 0 ||
        PyModule_AddObject(m, "BOARD_OFFSETS", Py_BuildValue(
            "{sisisisisisisisisi}", "bytes", BOARD_BYTES, "failed", BOARD_FAILED, "kind", BOARD_KIND, "pid", BOARD_PID,
            "layer", BOARD_LAYER, "npages", BOARD_NPAGES, "claim", BOARD_CLAIM, "pages", BOARD_PAGES,
            "message", BOARD_MESSAGE)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
