/* The fetch job's run function (fetch/_fetch.c): one step of a cached layer's rows, within its
 * deadline, from the daemon (daemon.h) hedged by the reader thread's direct reads
 * (reader.h); the module docstring of _fetch.c gives the steps.
 *
 *   engram_fetch_host_fn(call)   what cuLaunchHostFunc / hipLaunchHostFunc runs: no GIL, no GPU call
 *   job_run(core, n)             the same for n rows: returns at once when the core is closed
 *
 * One host copy: when the connection's daemon took the staging (c->split), the request opens the
 * staging's gate and the daemon writes the rows into the staging itself; the step then copies nothing.
 * A step that gives up on such a request (hedged, an error, the deadline) revokes the gate before any
 * row of its own goes in, waiting (at most to its deadline) when the daemon is writing at that moment:
 * so no daemon writes into the staging after the step returns, and the winner's rows are the ones the
 * step leaves. A daemon still writing at the deadline (stopped mid-copy) fails the step, and every later
 * step at once, until its write ends or the daemon is gone (its process exited, or its connection hung
 * up: writer.h, which works across PID namespaces).
 */
#ifndef ENGRAM_STORE_FETCH_RUN_H
#define ENGRAM_STORE_FETCH_RUN_H

#include <stdint.h>

#include "core.h"

enum { D_NONE, D_WANT, D_RUNNING, D_HELD, D_UNAVAILABLE, D_REFUSED };  /* this step's direct read */
#define BUDGET_RETRY_NS 2000000LL /* a step the node's direct-read budget refused asks it again this often */

/* What cudaLaunchHostFunc runs (and the CPU path calls): no GIL, no CUDA, no Python. */
void engram_fetch_host_fn(void *call);
/* A pthread running engram_fetch_host_fn(call): run_in_native_thread's proof that no GIL is needed. */
void *run_in_thread(void *call);

#endif
