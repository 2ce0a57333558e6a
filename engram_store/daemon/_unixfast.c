/* The daemon's native path for resident lookups over the Unix socket.
 *
 * Conn(fd, region, ids, layers, row_bytes, weight_bytes, threads, max_rows, busy_poll_ns)
 *     One client connection. `region` is the client's shared region (writable
 *     buffer), `ids` a writable int64 buffer the row ids are copied into before
 *     the gather (the client may rewrite its region at any time), `layers` a dict
 *     {layer: (weights, scales)} of the resident arena in the engines' layout:
 *     C-contiguous buffers of rows * weight_bytes and rows * (row_bytes -
 *     weight_bytes) bytes. A row is sent as its weights then its scales.
 *
 * Conn.set_staging(weights, scales, gate)
 *     The client's staging (daemon/requests/staging.py checked and mapped it): LOOKUPs with FLAG_SPLIT write their
 *     rows there in the split layout, under its gate (engram_store/wire/staging.py), from the arena or,
 *     when every row is cached, the row cache; the others go to Python as any lookup it leaves.
 *
 * Conn.next() -> tuple, without the GIL until it returns:
 *     reads the next frame header (busy-polling the socket for busy_poll_ns first,
 *     when no other connection is polling), and when it is a well-formed int64
 *     LOOKUP of a served layer inside the region, whose ids fit `ids` and are all
 *     in range, copies the ids, gathers the rows into the region and sends the
 *     RESULT header. Returns
 *         (SERVED, layer, count, seconds)   answered; the caller records it
 *         (FRAME, header)                   anything else: the caller handles the frame
 *                                           exactly as it would have (errors, other ops)
 *         (EOF, partial_header)             the peer closed the connection
 *     and raises OSError when the socket fails. A RESULT that cannot be sent
 *     (the client stopped reading for longer than the socket's send timeout)
 *     shuts the socket down; the next call then sees EOF.
 *
 * Fair share: a lookup of more than FAIR_PIECE_ROWS rows is gathered in pieces of
 * that many rows, and before each piece it waits while small lookups of other
 * connections are gathering (up to MAX_YIELD_NS per piece, unixfast_io.c, so large ones still
 * move): a decode-sized lookup beside clients looping 1M-row lookups has the
 * gather pool and the CPUs to itself from the next piece boundary on.
 * fair_stats() counts the pieces and the waits. (Measured on a shared 2-core host:
 * pieces taking turns process-wide, or one gather thread fewer for large lookups
 * while small ones come, cut large lookups' throughput and did not measurably
 * lower a decode client's p99; see the commit that removed them.)
 *
 * Why native: in Python the frame, the checks and the reply took ~80 us per
 * request around a 200 us decode gather; the same path here takes a few.
 * The frame layout and constants are engram_store/daemon/wire.py's FRAME;
 * fastpath.py refuses this module if any constant it exports differs from wire.py.
 */
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gather_api.h"    /* engram_gather_api, gather_job_t: the gather pool of engram_store.native._gather */
#include "frame.h"         /* frame_t, MAGIC, VERSION, OP_*, DTYPE_INT64, FLAG_SPLIT, frame_fields() */
#include "unixfast_io.h"   /* Conn, gather_api, the fair share, now_ns, send_all, release_staging */
#include "cached_hits.h"   /* cache_t, cache_serve: lookups of cached layers whose rows are all cached */
#include "staging_serve.h" /* serve_split, Conn_set_staging: rows into a client's staging */

enum { SERVED = 0, FRAME = 1, PEER_EOF = 2 };

static atomic_flag poll_token = ATOMIC_FLAG_INIT; /* held by the one connection busy-polling, native or Python
                                                      (poll_token_try / poll_token_release) */

static void release(Conn *c) {
    if (!c->open) return;
    release_staging(c);
    c->open = 0;
    PyBuffer_Release(&c->region);
    PyBuffer_Release(&c->ids);
    for (Py_ssize_t i = 0; i < c->nlayers; i++) {
        PyBuffer_Release(&c->layers[i].weights);
        PyBuffer_Release(&c->layers[i].scales);
    }
    PyMem_Free(c->layers);
    c->layers = NULL;
    c->nlayers = 0;
    cache_release(&c->cache);
}

static void Conn_dealloc(Conn *c) {
    release(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Conn_init(Conn *c, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"fd", "region", "ids", "layers", "row_bytes", "weight_bytes", "threads", "max_rows",
                         "busy_poll_ns", "cache", NULL};
    PyObject *o_region, *o_ids, *o_layers, *o_cache = Py_None;
    long long row_bytes, weight_bytes, max_rows, busy_poll_ns;
    int fd, threads;
    if (c->open) {
        PyErr_SetString(PyExc_RuntimeError, "Conn is already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOO!LLiLL|O", kw, &fd, &o_region, &o_ids, &PyDict_Type, &o_layers,
                                     &row_bytes, &weight_bytes, &threads, &max_rows, &busy_poll_ns, &o_cache))
        return -1;
    if (row_bytes <= 0 || weight_bytes <= 0 || weight_bytes > row_bytes || threads < 1 || max_rows < 0 ||
        busy_poll_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "Conn: row_bytes, weight_bytes (<= row_bytes) and threads must be positive, "
                                          "max_rows and busy_poll_ns >= 0");
        return -1;
    }
    if (PyObject_GetBuffer(o_region, &c->region, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    if (PyObject_GetBuffer(o_ids, &c->ids, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&c->region);
        return -1;
    }
    c->open = 1; /* from here on release() undoes what is set up */
    c->fd = fd;
    c->row_bytes = (size_t)row_bytes;
    c->weight_bytes = (size_t)weight_bytes;
    c->threads = threads;
    c->max_rows = (uint64_t)max_rows;
    c->busy_poll_ns = busy_poll_ns;
    c->layers = PyMem_Calloc((size_t)PyDict_Size(o_layers) + 1, sizeof(layer_t));
    if (c->layers == NULL) {
        PyErr_NoMemory();
        release(c);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o_layers, &pos, &key, &value)) {
        layer_t *l = &c->layers[c->nlayers];
        l->layer = (int32_t)PyLong_AsLong(key);
        if (PyErr_Occurred()) {
            release(c);
            return -1;
        }
        if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2) {
            PyErr_SetString(PyExc_TypeError, "Conn: each layer must be a (weights, scales) tuple of buffers");
            release(c);
            return -1;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(value, 0), &l->weights, PyBUF_C_CONTIGUOUS) < 0) {
            release(c);
            return -1;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(value, 1), &l->scales, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&l->weights);
            release(c);
            return -1;
        }
        c->nlayers++; /* from here on release() frees both buffers of this layer */
        const Py_ssize_t rows = l->weights.len / (Py_ssize_t)c->weight_bytes;
        if (l->scales.len < rows * (Py_ssize_t)(c->row_bytes - c->weight_bytes)) {
            PyErr_SetString(PyExc_ValueError, "Conn: a layer's scales hold fewer rows than its weights");
            release(c);
            return -1;
        }
    }
    if (cache_init(&c->cache, o_cache, c->ids.len / 8, c->row_bytes) < 0) {
        release(c);
        return -1;
    }
    return 0;
}

/* Read one header into *f: busy-poll first (one connection at a time), then block.
   Returns bytes read (sizeof *f when complete, fewer on EOF) or -errno. */
static ssize_t read_header(Conn *c, frame_t *f) {
    char *buf = (char *)f;
    size_t got = 0;
    if (c->busy_poll_ns > 0 && !atomic_flag_test_and_set(&poll_token)) {
        int64_t deadline = now_ns() + c->busy_poll_ns;
        while (got < sizeof *f) {
            ssize_t r = recv(c->fd, buf + got, sizeof *f - got, MSG_DONTWAIT);
            if (r > 0) {
                got += (size_t)r;
            } else if (r == 0) {
                break;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (now_ns() > deadline) break;
                sched_yield();
            } else if (errno != EINTR) {
                int err = errno;
                atomic_flag_clear(&poll_token);
                return -err;
            }
        }
        atomic_flag_clear(&poll_token);
    }
    while (got < sizeof *f) {
        ssize_t r = recv(c->fd, buf + got, sizeof *f - got, 0);
        if (r > 0)
            got += (size_t)r;
        else if (r == 0)
            break;
        else if (errno != EINTR)
            return -errno;
    }
    return (ssize_t)got;
}

/* Rows of a resident layer (its two blocks; scale_bytes 0: the payload block alone) into packed rows at out. */
static gather_job_t arena_job(const layer_t *l, int64_t rows, size_t weight_bytes, size_t scale_bytes,
                              const int64_t *ids, int64_t n, char *out) {
    return (gather_job_t){.src = l->weights.buf, .src2 = scale_bytes ? l->scales.buf : NULL, .rows = rows,
                          .row_bytes = weight_bytes, .row_bytes2 = scale_bytes, .idx = ids, .n = n, .out = out};
}

/* Serve *f if it is a lookup this path takes; 1 if answered, 0 to leave it to the caller. */
static int serve(Conn *c, const frame_t *f, double *seconds, uint64_t *served_rows) {
    int64_t t0 = now_ns();
    if (f->magic != MAGIC || f->version != VERSION || f->op != OP_LOOKUP || f->payload_bytes != 0 ||
        f->dtype != DTYPE_INT64)
        return 0;
    if (f->flags & FLAG_SPLIT) return serve_split(c, f, seconds, served_rows);
    *served_rows = f->count;
    const layer_t *l = NULL;
    for (Py_ssize_t i = 0; i < c->nlayers; i++)
        if (c->layers[i].layer == f->layer) l = &c->layers[i];
    const cached_layer_t *cached = l == NULL ? cache_layer(&c->cache, f->layer) : NULL;
    const uint64_t n = f->count, size = (uint64_t)c->region.len, rb = c->row_bytes;
    if ((l == NULL && cached == NULL) || n == 0 || n > c->max_rows || n > (uint64_t)c->ids.len / 8) return 0;
    if (f->ids_offset % 8 || f->out_offset % 8 || f->ids_offset > size || f->out_offset > size ||
        n * 8 > size - f->ids_offset || n * rb > size - f->out_offset)
        return 0;
    const uint64_t ids_end = f->ids_offset + n * 8, out_end = f->out_offset + n * rb;
    if (f->ids_offset < out_end && f->out_offset < ids_end) return 0; /* ids and rows overlap */
    gather_api->prime();
    char *region = c->region.buf;
    int64_t *ids = c->ids.buf;
    memcpy(ids, region + f->ids_offset, n * 8);
    char *out = region + f->out_offset;
    const size_t wb = c->weight_bytes;
    const int64_t rows = l != NULL ? l->weights.len / (Py_ssize_t)wb : 0;
    if (cached != NULL) { /* served only when every row is cached; a decode or prefill-chunk size */
        if (n > FAIR_PIECE_ROWS) return 0;
        atomic_fetch_add(&small_active, 1);
        if (!cache_serve(&c->cache, cached, ids, (int64_t)n, out, rb, c->threads)) {
            small_done();
            return 0;
        }
    } else if (n <= FAIR_PIECE_ROWS) {
        atomic_fetch_add(&small_active, 1);
        const gather_job_t job = arena_job(l, rows, wb, rb - wb, ids, (int64_t)n, out);
        const int64_t bad = gather_api->run(&job, c->threads);
        if (bad >= 0) {
            small_done();
            return 0; /* an id out of range: the caller answers with the error */
        }
    } else {
        for (uint64_t i = 0; i < n; i++) /* every id first: on an error nothing is copied */
            if ((uint64_t)ids[i] >= (uint64_t)rows) return 0;
        for (uint64_t at = 0; at < n; at += FAIR_PIECE_ROWS) {
            const uint64_t len = n - at < FAIR_PIECE_ROWS ? n - at : FAIR_PIECE_ROWS;
            yield_to_small();
            const gather_job_t job = arena_job(l, rows, wb, rb - wb, ids + at, (int64_t)len, out + at * rb);
            gather_api->run(&job, c->threads);
            pieces_served++;
        }
    }
    frame_t reply = {.magic = MAGIC, .version = VERSION, .op = OP_RESULT, .layer = f->layer,
                     .request_id = f->request_id, .count = n};
    if (n <= FAIR_PIECE_ROWS) small_done(); /* before the send: a client that does not read holds no one up */
    if (send_all(c->fd, &reply, sizeof reply) < 0) shutdown(c->fd, SHUT_RDWR);
    *seconds = (double)(now_ns() - t0) / 1e9;
    return 1;
}

static PyObject *Conn_next(Conn *c, PyObject *Py_UNUSED(args)) {
    if (!c->open) {
        PyErr_SetString(PyExc_ValueError, "Conn is closed");
        return NULL;
    }
    frame_t f;
    ssize_t got;
    int served = 0;
    double seconds = 0.0;
    uint64_t rows = 0;
    Py_BEGIN_ALLOW_THREADS
    got = read_header(c, &f);
    if (got == (ssize_t)sizeof f) served = serve(c, &f, &seconds, &rows);
    Py_END_ALLOW_THREADS
    if (got < 0) {
        errno = (int)-got;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (served) return Py_BuildValue("(iiKd)", SERVED, (int)f.layer, (unsigned long long)rows, seconds);
    return Py_BuildValue("(iy#)", got == (ssize_t)sizeof f ? FRAME : PEER_EOF, (const char *)&f, (Py_ssize_t)got);
}

static PyObject *Conn_close(Conn *c, PyObject *Py_UNUSED(args)) {
    release(c);
    Py_RETURN_NONE;
}

static PyObject *fair_stats(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return Py_BuildValue("{sKsK}", "pieces", (unsigned long long)atomic_load(&pieces_served), "yielded",
                         (unsigned long long)atomic_load(&pieces_yielded));
}

static PyObject *poll_token_try(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(!atomic_flag_test_and_set(&poll_token));
}

static PyObject *poll_token_release(PyObject *self, PyObject *noargs) {
    atomic_flag_clear(&poll_token);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"poll_token_try", poll_token_try, METH_NOARGS,
     "poll_token_try() -> bool: take the process's one busy-poll token if free (native connections share it)"},
    {"poll_token_release", poll_token_release, METH_NOARGS, "poll_token_release(): give the busy-poll token back"},
    {"fair_stats", fair_stats, METH_NOARGS,
     "fair_stats() -> {'pieces': pieces of large lookups gathered, 'yielded': of them, those that waited for small lookups}"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Conn_methods[] = {
    {"next", (PyCFunction)Conn_next, METH_NOARGS, "next() -> (SERVED, layer, count, seconds) | (FRAME, header) | (EOF, partial)"},
    {"close", (PyCFunction)Conn_close, METH_NOARGS, "close() -> None: release the buffers (idempotent)"},
    {"set_staging", (PyCFunction)Conn_set_staging, METH_VARARGS,
     "set_staging(weights, scales, gate) -> None: the client's staging for Flag.SPLIT lookups (wire/staging.py)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engram_store.daemon._unixfast.Conn",
    .tp_basicsize = sizeof(Conn),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One Unix client served natively (resident lookups); see the module docstring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Conn_init,
    .tp_dealloc = (destructor)Conn_dealloc,
    .tp_methods = Conn_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_unixfast", "The daemon's native path for resident Unix lookups.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__unixfast(void) {
    /* PyCapsule_Import walks attributes: the submodule must be imported first. */
    PyObject *gather_module = PyImport_ImportModule("engram_store.native._gather");
    if (gather_module == NULL) return NULL;
    Py_DECREF(gather_module);
    gather_api = PyCapsule_Import(ENGRAM_GATHER_CAPSULE, 0);
    if (gather_api == NULL || PyType_Ready(&ConnType) < 0) return NULL;
    pthread_atfork(NULL, NULL, reset_fair_share_in_child);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&ConnType);
    if (PyModule_AddObject(m, "Conn", (PyObject *)&ConnType) < 0 ||
        PyModule_AddIntConstant(m, "FRAME_SIZE", sizeof(frame_t)) < 0 ||
        PyModule_AddIntConstant(m, "MAGIC", MAGIC) < 0 || PyModule_AddIntConstant(m, "VERSION", VERSION) < 0 ||
        PyModule_AddIntConstant(m, "OP_LOOKUP", OP_LOOKUP) < 0 || PyModule_AddIntConstant(m, "OP_RESULT", OP_RESULT) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_INT64", DTYPE_INT64) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_SPLIT", FLAG_SPLIT) < 0 ||
        PyModule_AddIntConstant(m, "SPLIT_PAD_ID", SPLIT_PAD_ID) < 0 ||
        PyModule_AddIntConstant(m, "FAIR_PIECE_ROWS", FAIR_PIECE_ROWS) < 0 ||
        PyModule_AddIntConstant(m, "SERVED", SERVED) < 0 || PyModule_AddIntConstant(m, "FRAME", FRAME) < 0 ||
        PyModule_AddIntConstant(m, "EOF", PEER_EOF) < 0 ||
        PyModule_AddObject(m, "FRAME_FIELDS", frame_fields()) < 0) {
        Py_DECREF(&ConnType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
