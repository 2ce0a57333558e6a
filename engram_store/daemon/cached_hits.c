/* The native path's cached layers (cached_hits.h). */
#include "cached_hits.h"

#include <string.h>

#include "gather_api.h"   /* gather_job_t */
#include "staging_gate.h" /* gate_claim, gate_done */
#include "unixfast_io.h"  /* gather_api */

void cache_release(cache_t *k) {
    for (Py_ssize_t i = 0; i < k->nlayers; i++) PyBuffer_Release(&k->layers[i].map);
    PyMem_Free(k->layers);
    if (k->have_slots) PyBuffer_Release(&k->slots);
    if (k->have_counts) PyBuffer_Release(&k->counts);
    Py_CLEAR(k->guard);
    PyMem_Free(k->found);
    PyMem_Free(k->slot);
    PyMem_Free(k->next);
    memset(k, 0, sizeof *k);
}

static int cache_fail(cache_t *k, const char *why) {
    PyErr_Format(PyExc_ValueError, "Conn: cache %s", why);
    cache_release(k);
    return -1;
}

int cache_init(cache_t *k, PyObject *views, Py_ssize_t capacity, size_t row_bytes) {
    memset(k, 0, sizeof *k);
    if (views == Py_None) return 0;
    if (!PyDict_Check(views)) return cache_fail(k, "must be a dict (RowCache.native_views) or None");
    PyObject *maps = PyDict_GetItemString(views, "maps"), *slots = PyDict_GetItemString(views, "slots");
    PyObject *counts = PyDict_GetItemString(views, "counts"), *cap = PyDict_GetItemString(views, "count_cap");
    PyObject *guard = PyDict_GetItemString(views, "guard");
    if (!maps || !PyDict_Check(maps) || !slots || !counts || !cap || !guard)
        return cache_fail(k, "needs maps (a dict), slots, counts, count_cap and guard");
    if (!PyObject_TypeCheck(guard, gather_api->guard_type)) return cache_fail(k, "guard must be an EpochGuard");
    k->guard = Py_NewRef(guard);
    k->count_cap = (int)PyLong_AsLong(cap);
    if (PyErr_Occurred() || k->count_cap < 1 || k->count_cap > 255) return cache_fail(k, "count_cap must be in 1..255");
    if (PyObject_GetBuffer(slots, &k->slots, PyBUF_C_CONTIGUOUS) < 0) return cache_release(k), -1;
    k->have_slots = 1;
    if (PyObject_GetBuffer(counts, &k->counts, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return cache_release(k), -1;
    k->have_counts = 1;
    if (k->counts.len < k->slots.len / (Py_ssize_t)row_bytes) return cache_fail(k, "counts hold fewer slots than slots");
    k->layers = PyMem_Calloc((size_t)PyDict_Size(maps) + 1, sizeof(cached_layer_t));
    k->found = PyMem_Malloc((size_t)capacity * sizeof(int32_t) + 1);
    k->slot = PyMem_Malloc((size_t)capacity * sizeof(int64_t) + 1);
    k->next = PyMem_Malloc((size_t)capacity + 1);
    if (!k->layers || !k->found || !k->slot || !k->next) {
        cache_release(k);
        PyErr_NoMemory();
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(maps, &pos, &key, &value)) {
        cached_layer_t *l = &k->layers[k->nlayers];
        l->layer = (int32_t)PyLong_AsLong(key);
        if (PyErr_Occurred() || PyObject_GetBuffer(value, &l->map, PyBUF_C_CONTIGUOUS) < 0) return cache_release(k), -1;
        k->nlayers++;
        if (l->map.itemsize != 4) return cache_fail(k, "maps must be int32 arrays");
    }
    return 0;
}

const cached_layer_t *cache_layer(const cache_t *k, int32_t layer) {
    for (Py_ssize_t i = 0; i < k->nlayers; i++)
        if (k->layers[i].layer == layer) return &k->layers[i];
    return NULL;
}

/* When every row of ids[0..n) of `l` is cached: their slots in k->slot, hit counts raised, a reader epoch
   entered (its token returned; end with guard_leave once the slots are read). -1 to leave the lookup to Python. */
static int64_t cache_enter(const cache_t *k, const cached_layer_t *l, const int64_t *ids, int64_t n,
                           size_t row_bytes) {
    const int64_t rows = l->map.len / 4, n_slots = k->slots.len / (Py_ssize_t)row_bytes;
    gather_api->guard_lock(k->guard);
    if (gather_api->take_int32(l->map.buf, rows, ids, n, k->found) >= 0) { /* an id outside the layer */
        gather_api->guard_unlock(k->guard);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (k->found[i] <= 0 || k->found[i] > n_slots) { /* a miss */
            gather_api->guard_unlock(k->guard);
            return -1;
        }
        k->slot[i] = k->found[i] - 1;
    }
    gather_api->bump_counts(k->counts.buf, k->counts.len, k->slot, 8, n, k->count_cap, k->next); /* slots < n_slots */
    const int64_t token = gather_api->guard_enter(k->guard);
    gather_api->guard_unlock(k->guard);
    return token;
}

int cache_serve(const cache_t *k, const cached_layer_t *l, const int64_t *ids, int64_t n, char *out,
                       size_t row_bytes, int threads) {
    const int64_t token = cache_enter(k, l, ids, n, row_bytes);
    if (token < 0) return 0;
    const gather_job_t job = {.src = k->slots.buf, .rows = k->slots.len / (Py_ssize_t)row_bytes, .row_bytes = row_bytes,
                              .idx = k->slot, .n = n, .out = out};
    gather_api->run(&job, threads);
    gather_api->guard_leave(k->guard, token);
    return 1;
}

int cache_serve_split(const cache_t *k, const cached_layer_t *l, const int64_t *ids, int64_t n, char *wout,
                             char *sout, const int64_t *pos, size_t weight_bytes, size_t scale_bytes, uint32_t *gate,
                             uint64_t request_id, int threads) {
    const size_t row_bytes = weight_bytes + scale_bytes;
    const int64_t token = cache_enter(k, l, ids, n, row_bytes);
    if (token < 0) return 0;
    const int claimed = gate_claim(gate, request_id);
    if (claimed) {
        const gather_job_t job = {.src = k->slots.buf, .rows = k->slots.len / (Py_ssize_t)row_bytes,
                                  .row_bytes = weight_bytes, .row_bytes2 = scale_bytes, .idx = k->slot, .n = n,
                                  .pos = pos, .wout = wout, .sout = sout};
        gather_api->run(&job, threads);
        gate_done(gate, request_id);
    }
    gather_api->guard_leave(k->guard, token);
    return claimed;
}
