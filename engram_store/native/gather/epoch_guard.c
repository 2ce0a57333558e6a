/* EpochGuard (epoch_guard.h): the type and its C functions. */
#include "epoch_guard.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int ready;
    int64_t epoch;
    int64_t *at, *count; /* registered epochs and their readers: [n], distinct epochs */
    int64_t n, cap;
} EpochGuard;

void guard_lock(void *g) { pthread_mutex_lock(&((EpochGuard *)g)->mu); }
void guard_unlock(void *g) { pthread_mutex_unlock(&((EpochGuard *)g)->mu); }

/* Lock held. Registers a reader at the current epoch; returns its token, or -1 when out of memory. */
int64_t guard_enter(void *p) {
    EpochGuard *g = p;
    for (int64_t i = 0; i < g->n; i++)
        if (g->at[i] == g->epoch) {
            g->count[i]++;
            return g->epoch;
        }
    if (g->n == g->cap) {
        const int64_t cap = g->cap ? 2 * g->cap : 16;
        int64_t *at = realloc(g->at, (size_t)cap * 8);
        if (at == NULL) return -1;
        g->at = at;
        int64_t *count = realloc(g->count, (size_t)cap * 8);
        if (count == NULL) return -1;
        g->count = count;
        g->cap = cap;
    }
    g->at[g->n] = g->epoch;
    g->count[g->n++] = 1;
    return g->epoch;
}

/* Lock held. A reader registered with `token` is done. */
static void guard_leave_locked(EpochGuard *g, int64_t token) {
    for (int64_t i = 0; i < g->n; i++)
        if (g->at[i] == token) {
            if (--g->count[i] == 0) {
                g->at[i] = g->at[g->n - 1];
                g->count[i] = g->count[g->n - 1];
                g->n--;
            }
            return;
        }
}

void guard_leave(void *g, int64_t token) {
    guard_lock(g);
    guard_leave_locked(g, token);
    guard_unlock(g);
}

static int guard_init(EpochGuard *g, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ":EpochGuard")) return -1;
    if (!g->ready) {
        pthread_mutex_init(&g->mu, NULL);
        g->ready = 1;
    }
    return 0;
}

static void guard_dealloc(EpochGuard *g) {
    if (g->ready) pthread_mutex_destroy(&g->mu);
    free(g->at);
    free(g->count);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *guard_acquire_py(EpochGuard *g, PyObject *Py_UNUSED(args)) {
    if (pthread_mutex_trylock(&g->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&g->mu);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *guard_release_py(EpochGuard *g, PyObject *Py_UNUSED(args)) {
    pthread_mutex_unlock(&g->mu);
    Py_RETURN_NONE;
}

static PyObject *guard_enter_py(EpochGuard *g, PyObject *Py_UNUSED(args)) {
    const int64_t token = guard_enter(g);
    return token < 0 ? PyErr_NoMemory() : PyLong_FromLongLong(token);
}

static PyObject *guard_leave_py(EpochGuard *g, PyObject *arg) {
    const long long token = PyLong_AsLongLong(arg);
    if (token == -1 && PyErr_Occurred()) return NULL;
    if (pthread_mutex_trylock(&g->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&g->mu);
        Py_END_ALLOW_THREADS
    }
    guard_leave_locked(g, token);
    pthread_mutex_unlock(&g->mu);
    Py_RETURN_NONE;
}

static PyObject *guard_advance_py(EpochGuard *g, PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong(g->epoch++);
}

static PyObject *guard_oldest_py(EpochGuard *g, PyObject *Py_UNUSED(args)) {
    if (g->n == 0) Py_RETURN_NONE;
    int64_t oldest = g->at[0];
    for (int64_t i = 1; i < g->n; i++)
        if (g->at[i] < oldest) oldest = g->at[i];
    return PyLong_FromLongLong(oldest);
}

static PyObject *guard_epoch_py(EpochGuard *g, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(g->epoch); }

static PyObject *guard_readers_py(EpochGuard *g, void *Py_UNUSED(closure)) {
    int64_t readers = 0;
    for (int64_t i = 0; i < g->n; i++) readers += g->count[i];
    return PyLong_FromLongLong(readers);
}

static PyMethodDef guard_methods[] = {
    {"__enter__", (PyCFunction)guard_acquire_py, METH_NOARGS, "take the lock (the GIL released while waiting)"},
    {"__exit__", (PyCFunction)guard_release_py, METH_VARARGS, "release the lock"},
    {"enter", (PyCFunction)guard_enter_py, METH_NOARGS, "enter() -> token: register a reader (lock held)"},
    {"leave", (PyCFunction)guard_leave_py, METH_O, "leave(token): the reader is done (takes the lock)"},
    {"advance", (PyCFunction)guard_advance_py, METH_NOARGS, "advance() -> the epoch before it moved on (lock held)"},
    {"oldest", (PyCFunction)guard_oldest_py, METH_NOARGS, "oldest() -> the oldest registered epoch, or None (lock held)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef guard_getset[] = {
    {"epoch", (getter)guard_epoch_py, NULL, "the current epoch", NULL},
    {"readers", (getter)guard_readers_py, NULL, "readers registered now (lock held)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject EpochGuardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engram_store.native._gather.EpochGuard",
    .tp_basicsize = sizeof(EpochGuard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The row cache's lock and reader epochs, shared with native readers (epoch_guard.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)guard_init,
    .tp_dealloc = (destructor)guard_dealloc,
    .tp_methods = guard_methods,
    .tp_getset = guard_getset,
};
