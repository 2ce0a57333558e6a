/* The host-function launch of the GPU runtime torch runs on (host_launch.h), asked of the Python seam. */
#include "host_launch.h"

#include <stdint.h>
#include <stdio.h>

static PyObject *gpu_host_launcher;  /* engram_store.native.gpu_runtime.host_launcher, looked up once */

int gpu_launcher_get(gpu_launcher *out) {
    if (gpu_host_launcher == NULL) {
        PyObject *mod = PyImport_ImportModule("engram_store.native.gpu_runtime");
        if (mod == NULL) return -1;
        gpu_host_launcher = PyObject_GetAttrString(mod, "host_launcher");
        Py_DECREF(mod);
        if (gpu_host_launcher == NULL) return -1;
    }
    PyObject *r = PyObject_CallNoArgs(gpu_host_launcher);
    if (r == NULL) return -1;
    unsigned long long address = 0;
    const char *name = NULL, *result_type = NULL;
    int ok = PyTuple_Check(r) && PyArg_ParseTuple(r, "Kss", &address, &name, &result_type);
    if (ok && address == 0) {
        PyErr_SetString(PyExc_RuntimeError, "the GPU runtime gave a null host-function launch");
        ok = 0;
    } else if (!ok && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "gpu_runtime.host_launcher() must return (address, name, result type)");
    }
    if (ok) {
        out->launch = (gpu_launch_host_fn)(uintptr_t)address;
        snprintf(out->name, sizeof out->name, "%s", name);
        snprintf(out->result_type, sizeof out->result_type, "%s", result_type);
    }
    Py_DECREF(r);
    return ok ? 0 : -1;
}
