"""A captured CUDA graph's nodes, counted by type through the GPU runtime torch uses (``cudaGraphGetNodes``,
``cudaGraphNodeGetType``, ``cudaGraphMemcpyNodeGetParams`` for where each copy goes): bench/_device_cached.py
checks that a cached layer's chain holds one copy (the ids to the host), one host node and the engine's
kernel, and no copy node the engines do not build."""

from __future__ import annotations

import ctypes

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child_graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_signal", 9: "ext_wait", 10: "mem_alloc", 11: "mem_free"}


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Memcpy3DParms(ctypes.Structure):  # cudaMemcpy3DParms (driver_types.h)
    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr),
                ("extent", _Pos), ("kind", ctypes.c_int)]


def graph_nodes(raw_graph: int, ids_ptrs: list[int], rt=None) -> dict[str, int]:
    """Node counts of a captured graph by type, through the GPU runtime torch uses (or ``rt``, a
    :class:`~engram_store.native.gpu_runtime.GpuRuntime`); ``memcpy_to_ids``: memcpy nodes whose
    destination is one of ``ids_ptrs`` (the jobs' ids: the chain's one copy), ``memcpy_other`` the rest
    (-1 each when a memcpy node's parameters could not be read)."""
    if rt is None:
        from engram_store.native.gpu_runtime import runtime

        rt = runtime()
    lib, p = ctypes.CDLL(rt.runtime_lib), rt.side.prefix
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    get_nodes = getattr(lib, f"{p}GraphGetNodes")
    get_nodes.restype, get_nodes.argtypes = ctypes.c_int, [vp, vp, ctypes.POINTER(sz)]
    get_type = getattr(lib, f"{p}GraphNodeGetType")
    get_type.restype, get_type.argtypes = ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_int)]
    get_copy = getattr(lib, f"{p}GraphMemcpyNodeGetParams", None)
    if get_copy is not None:
        get_copy.restype, get_copy.argtypes = ctypes.c_int, [vp, ctypes.POINTER(_Memcpy3DParms)]
    count = sz(0)
    if (code := get_nodes(raw_graph, None, ctypes.byref(count))) != 0:
        rt.clear_last_error()
        raise RuntimeError(f"{p}GraphGetNodes failed: {rt.error_name(code)}")
    nodes = (vp * max(1, count.value))()
    if (code := get_nodes(raw_graph, nodes, ctypes.byref(count))) != 0:
        rt.clear_last_error()
        raise RuntimeError(f"{p}GraphGetNodes failed: {rt.error_name(code)}")
    out: dict[str, int] = {"memcpy_to_ids": 0, "memcpy_other": 0}
    targets = set(ids_ptrs)
    for i in range(count.value):
        kind = ctypes.c_int(-1)
        if get_type(nodes[i], ctypes.byref(kind)) != 0:
            rt.clear_last_error()
        name = NODE_TYPES.get(kind.value, f"type{kind.value}")
        out[name] = out.get(name, 0) + 1
        if name != "memcpy":
            continue
        params = _Memcpy3DParms()
        if get_copy is None or get_copy(nodes[i], ctypes.byref(params)) != 0:
            rt.clear_last_error()
            out["memcpy_to_ids"] = out["memcpy_other"] = -1
        elif out["memcpy_to_ids"] >= 0:
            dst = (params.dstPtr.ptr or 0) + params.dstPos.x
            out["memcpy_to_ids" if dst in targets else "memcpy_other"] += 1
    return out
