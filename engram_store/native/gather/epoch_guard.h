/* The row cache's lock and reader epochs, shared by Python (storage/row_cache.py) and native readers (the
 * daemon's Unix fast path), so both read cache slots under one rule. A unit of _gather (epoch_guard.c), which
 * exports the type as _gather.EpochGuard and its C functions through engram_gather_api (gather_api.h).
 *
 * The rule (row_cache.py): a reader holds the lock while it maps rows to slots and registers the current
 * epoch (enter); it copies out of the slots after releasing the lock and leaves with its token. An
 * eviction retires slots with the epoch of their eviction and advances the epoch; retired slots are
 * reused only once no reader registered at or before that epoch is left (oldest).
 *
 * Python: `with guard:` holds the lock (the GIL released while waiting); enter() -> token (lock held),
 * leave(token) (takes the lock), advance() -> the epoch before it moved on (lock held), oldest() -> the
 * oldest registered epoch or None (lock held), epoch, readers.
 */
#ifndef ENGRAM_STORE_EPOCH_GUARD_H
#define ENGRAM_STORE_EPOCH_GUARD_H

#include <Python.h>
#include <stdint.h>

extern PyTypeObject EpochGuardType;

/* On an EpochGuard: */
void guard_lock(void *guard);
void guard_unlock(void *guard);
/* Lock held. Registers a reader at the current epoch; returns its token, or -1 when out of memory. */
int64_t guard_enter(void *guard);
/* A reader registered with `token` is done (takes the lock). */
void guard_leave(void *guard, int64_t token);

#endif
