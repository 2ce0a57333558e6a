/* frame_fields(): the layout of frame_t (frame.h) as wire.frames.check_native_layout reads it. */
#include "frame.h"

#define FRAME_FIELD(name) Py_BuildValue("(snn)", #name, (Py_ssize_t)offsetof(frame_t, name), \
                                        (Py_ssize_t)sizeof(((frame_t *)0)->name))

PyObject *frame_fields(void) {
    PyObject *items[] = {FRAME_FIELD(magic), FRAME_FIELD(version), FRAME_FIELD(op), FRAME_FIELD(status),
                         FRAME_FIELD(dtype), FRAME_FIELD(flags), FRAME_FIELD(layer), FRAME_FIELD(request_id),
                         FRAME_FIELD(count), FRAME_FIELD(ids_offset), FRAME_FIELD(out_offset),
                         FRAME_FIELD(payload_bytes), FRAME_FIELD(reserved)};
    const Py_ssize_t n = (Py_ssize_t)(sizeof(items) / sizeof(items[0]));
    PyObject *fields = PyTuple_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (fields == NULL || items[i] == NULL) {
            for (Py_ssize_t j = i; j < n; j++) Py_XDECREF(items[j]);
            Py_XDECREF(fields);
            return NULL;
        }
        PyTuple_SET_ITEM(fields, i, items[i]); /* steals the reference */
    }
    return fields;
}
