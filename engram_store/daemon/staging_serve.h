/* The native path's Flag.SPLIT lookups: rows written into a client's staging in the engines' split layout
 * (one host copy, engram_store/wire/staging.py), under the staging's gate (native/common/staging_gate.h).
 * A unit of _unixfast (staging_serve.c).
 *
 *   Conn.set_staging(weights, scales, gate)   the staging daemon/requests/staging.py checked and mapped
 *   serve_split(c, f, ...)                    one lookup: 1 answered, 0 left to the Python reader
 */
#ifndef ENGRAM_STORE_STAGING_SERVE_H
#define ENGRAM_STORE_STAGING_SERVE_H

#include <Python.h>
#include <stdint.h>

#include "frame.h"
#include "unixfast_io.h"

/* A Flag.SPLIT lookup: 1 answered (*rows: the ids served), 0 left to the caller. */
int serve_split(Conn *c, const frame_t *f, double *seconds, uint64_t *rows);
/* Conn.set_staging(weights, scales, gate). */
PyObject *Conn_set_staging(Conn *c, PyObject *args);

#endif
