/* The fault hooks tests turn on in native code, declared in one place (test_hooks.c).
 *
 * Production code only asks: test_hook_on(h) (a relaxed atomic load), test_hook_hold(h) (waits while
 * h is on; returns at once when it is off). Python sets them through one module function of each
 * extension linking this unit, TEST_HOOKS_METHOD (tests call it only through tests/support/faults.py):
 *
 *   test_hooks(**flags) -> {name: bool}   set the named hooks, return every hook's state
 *
 * The hooks:
 *   hold_reads       every fetch-job reader thread waits before its next request while set (a device
 *                    that does not answer: tests/test_fetch_deadlines.py)
 *   without_pidfds   connections attached while set get no pidfd of their daemon (an older kernel across
 *                    PID namespaces): a daemon gone mid-write is seen by its connection alone
 *                    (tests/engines/namespace_fetch_job.py)
 */
#ifndef ENGRAM_STORE_TEST_HOOKS_H
#define ENGRAM_STORE_TEST_HOOKS_H

#include <Python.h>

typedef enum { TEST_HOOK_HOLD_READS = 0, TEST_HOOK_WITHOUT_PIDFDS = 1, TEST_HOOK_COUNT } test_hook_t;

int test_hook_on(test_hook_t hook);
void test_hook_hold(test_hook_t hook);

PyObject *test_hooks_py(PyObject *self, PyObject *args, PyObject *kw);
#define TEST_HOOKS_METHOD                                                                                      \
    {"test_hooks", (PyCFunction)(void (*)(void))test_hooks_py, METH_VARARGS | METH_KEYWORDS,                  \
     "test_hooks(**flags) -> {name: bool}: for tests, set the named fault hooks (hold_reads, without_pidfds: "  \
     "native/common/test_hooks.h) and return every hook's state"}

#endif
