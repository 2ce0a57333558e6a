/* The GPU runtime's host-function launch, for the fetch job: cuLaunchHostFunc (CUDA driver) or
 * hipLaunchHostFunc (ROCm), whichever torch runs on. The choice and the lookup are made once, in Python,
 * by engram_store/native/gpu_runtime/__init__.py (the GPU-runtime seam: host_launcher() -> (address, name, result
 * type)); nothing here links either runtime, so the module builds and loads on hosts with neither.
 * Both launches take (stream, void (*fn)(void *), void *data) and return 0 on success.
 */
#ifndef ENGRAM_GPU_HOST_LAUNCH_H
#define ENGRAM_GPU_HOST_LAUNCH_H

#include <Python.h>

typedef int (*gpu_launch_host_fn)(void *stream, void (*fn)(void *), void *data);

typedef struct {
    gpu_launch_host_fn launch;
    char name[64];         /* "cuLaunchHostFunc" / "hipLaunchHostFunc", for messages */
    char result_type[32];  /* "CUresult" / "hipError_t" */
} gpu_launcher;

/* Fills *out from the seam (asked at every launch: tests switch runtimes; about half a microsecond);
   0, or -1 with a Python exception set (no GPU runtime: the seam says why). Call with the GIL held. */
int gpu_launcher_get(gpu_launcher *out);

#endif
