/* The GPU runtime's host-function launch, for the fetch job: cuLaunchHostFunc (CUDA driver) or
 * hipLaunchHostFunc (ROCm), whichever torch runs on. The choice and the lookup are made once, in Python,
 * by engram_store/native/gpu_runtime.py (the GPU-runtime seam: host_launcher() -> (address, name, result
 * type)); nothing here links either runtime, so the module builds and loads on hosts with neither.
 * Both launches take (stream, void (*fn)(void *), void *data) and return 0 on success.
 */
#ifndef ENGRAM_GPU_RUNTIME_H
#define ENGRAM_GPU_RUNTIME_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*gpu_launch_host_fn)(void *stream, void (*fn)(void *), void *data);

typedef struct {
    gpu_launch_host_fn launch;
    char name[64];         /* "cuLaunchHostFunc" / "hipLaunchHostFunc", for messages */
    char result_type[32];  /* "CUresult" / "hipError_t" */
} gpu_launcher;

static PyObject *gpu_host_launcher;  /* engram_store.native.gpu_runtime.host_launcher, looked up once */

/* Fills *out from the seam (asked at every launch: tests switch runtimes; about half a microsecond);
   0, or -1 with a Python exception set (no GPU runtime: the seam says why). Call with the GIL held. */
static int gpu_launcher_get(gpu_launcher *out) {
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

#endif
