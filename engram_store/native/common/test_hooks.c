/* The fault hooks of test_hooks.h: one flag each, a condition variable for the hooks that hold a thread. */
#include "test_hooks.h"

#include <pthread.h>
#include <stdatomic.h>

static const char *const names[TEST_HOOK_COUNT] = {"hold_reads", "without_pidfds"};
static _Atomic int flags[TEST_HOOK_COUNT];
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;

int test_hook_on(test_hook_t hook) { return atomic_load_explicit(&flags[hook], memory_order_relaxed); }

void test_hook_hold(test_hook_t hook) {
    if (!test_hook_on(hook)) return;
    pthread_mutex_lock(&hold_mu);
    while (atomic_load(&flags[hook])) pthread_cond_wait(&hold_cv, &hold_mu);
    pthread_mutex_unlock(&hold_mu);
}

static void set_hook(int hook, int on) {
    pthread_mutex_lock(&hold_mu);
    atomic_store(&flags[hook], on);
    pthread_cond_broadcast(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
}

PyObject *test_hooks_py(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "test_hooks takes keyword arguments only: test_hooks(hold_reads=True)");
        return NULL;
    }
    PyObject *key, *value;
    Py_ssize_t at = 0;
    while (kw != NULL && PyDict_Next(kw, &at, &key, &value)) { /* every name checked before any is set */
        int known = 0;
        for (int h = 0; h < TEST_HOOK_COUNT; h++) known |= PyUnicode_CompareWithASCIIString(key, names[h]) == 0;
        if (!known) {
            PyErr_Format(PyExc_TypeError, "test_hooks: no hook %R (hold_reads, without_pidfds)", key);
            return NULL;
        }
    }
    for (int h = 0; h < TEST_HOOK_COUNT; h++) {
        PyObject *v = kw != NULL ? PyDict_GetItemString(kw, names[h]) : NULL;
        if (v == NULL) continue;
        const int on = PyObject_IsTrue(v);
        if (on < 0) return NULL;
        set_hook(h, on);
    }
    PyObject *state = PyDict_New();
    for (int h = 0; state != NULL && h < TEST_HOOK_COUNT; h++) {
        if (PyDict_SetItemString(state, names[h], test_hook_on(h) ? Py_True : Py_False) < 0) Py_CLEAR(state);
    }
    return state;
}
