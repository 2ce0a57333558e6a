/* The Unix-socket frame header (engram_store/wire/frames.py FRAME), for the C modules that speak
 * the protocol: the daemon's native path (daemon/_unixfast.c) and the engines' fetch job
 * (fetch/_fetch.c); frame_fields() is defined in frame.c.
 *
 * frame_fields() builds the ((name, offset, size), ...) tuple each module exports as FRAME_FIELDS;
 * wire.frames.check_native_layout compares it with the Python declaration before the module is
 * used, so a stale build is refused instead of misreading frames.
 */
#ifndef ENGRAM_STORE_FRAME_H
#define ENGRAM_STORE_FRAME_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define MAGIC 0x52474E45u
#define VERSION 1
#define OP_LOOKUP 3
#define OP_RESULT 4
#define OP_STAGING 7
#define OP_HINT 8      /* wire.Op.HINT: answered by the Python reader (the native path hands it over) */
#define OP_WITHDRAW 9  /* wire.Op.WITHDRAW: likewise */
#define DTYPE_INT64 1
#define FLAG_SPLIT 4      /* LOOKUP: rows into the connection's staging, split layout (wire/staging.py) */
#define SPLIT_PAD_ID (-1) /* wire.staging.PAD_ID: a position of a Flag.SPLIT lookup the daemon leaves alone */
#define MAX_DAEMON_PAYLOAD (16 << 20)  /* wire.MAX_DAEMON_PAYLOAD */

/* Little-endian, no padding. */
typedef struct __attribute__((packed)) {
    uint32_t magic;
    uint16_t version, op, status;
    uint8_t dtype, flags;
    int32_t layer;
    uint64_t request_id, count, ids_offset, out_offset;
    uint32_t payload_bytes, reserved;
} frame_t;
_Static_assert(sizeof(frame_t) == 56, "frame_t must match wire.FRAME");

/* ((name, offset, size), ...) of frame_t, in order (a new reference, or NULL with an exception). */
PyObject *frame_fields(void);

#endif
