"""The parts of bench/device_check.py's cached-chain checks that do not need a GPU to be checked: the
captured graph's node count (read through a stand-in of the CUDA runtime's graph calls, built here),
the node row's verdict, the filesystem a path is on (against util-linux's findmnt), and the host lanes'
ordering. The checks themselves run on the host in tests/test_gpu_client_bench.py."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _device_cached import MEMORY_FS, filesystem, nodes_row  # noqa: E402
from _device_graph import graph_nodes  # noqa: E402
from _device_lanes import HostLanes  # noqa: E402

GRAPH_STANDIN = r"""
#include <stddef.h>
#include <string.h>
/* cudaMemcpy3DParms and its parts as driver_types.h declares them */
struct cudaPos { size_t x, y, z; };
struct cudaPitchedPtr { void *ptr; size_t pitch, xsize, ysize; };
struct cudaExtent { size_t width, height, depth; };
struct cudaMemcpy3DParms {
    void *srcArray; struct cudaPos srcPos; struct cudaPitchedPtr srcPtr;
    void *dstArray; struct cudaPos dstPos; struct cudaPitchedPtr dstPtr;
    struct cudaExtent extent; int kind;
};
typedef struct { int type; void *dst; size_t dst_off; int params_fail; } node_t;
typedef struct { size_t n; node_t nodes[16]; } graph_t;
static __thread int last_error;

int cudaGraphGetNodes(graph_t *g, node_t **nodes, size_t *num) {
    if (!g || !num) return last_error = 1;
    if (nodes)
        for (size_t i = 0; i < g->n && i < *num; i++) nodes[i] = &g->nodes[i];
    *num = g->n;
    return 0;
}
int cudaGraphNodeGetType(node_t *node, int *type) { *type = node->type; return 0; }
int cudaGraphMemcpyNodeGetParams(node_t *node, struct cudaMemcpy3DParms *p) {
    if (node->params_fail) return last_error = 1;
    memset(p, 0xAB, sizeof *p);  /* every field written, as the runtime does */
    p->srcArray = p->dstArray = 0;
    p->srcPos.x = p->srcPos.y = p->srcPos.z = 0;
    p->dstPtr.ptr = node->dst;
    p->dstPos.x = node->dst_off; p->dstPos.y = p->dstPos.z = 0;
    p->kind = 2;
    return 0;
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
"""


class Node(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("dst", ctypes.c_void_p), ("dst_off", ctypes.c_size_t),
                ("params_fail", ctypes.c_int)]


class Graph(ctypes.Structure):
    _fields_ = [("n", ctypes.c_size_t), ("nodes", Node * 16)]


KERNEL, MEMCPY, HOST = 0, 1, 3


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the graph stand-in")
    d = tmp_path_factory.mktemp("graph-standin")
    (d / "g.c").write_text(GRAPH_STANDIN)
    lib = d / "libengram-graph-standin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(lib), str(d / "g.c")], check=True)
    c = ctypes.CDLL(str(lib))
    return SimpleNamespace(runtime_lib=str(lib), side=SimpleNamespace(prefix="cuda"),
                           clear_last_error=lambda: c.cudaGetLastError(),
                           error_name=lambda code: f"cudaError {code}")


def count(runtime, *nodes: tuple) -> dict[str, int]:
    """graph_nodes of a stand-in graph holding ``nodes`` (type, destination, offset, parameters unreadable)."""
    g = Graph(len(nodes))
    for i, (kind, dst, off, fail) in enumerate(nodes):
        g.nodes[i] = Node(kind, dst, off, fail)
    return graph_nodes(ctypes.addressof(g), [IDS], runtime)  # g alive until it returns


IDS = 0x7F00_0000_1000  # the job's ids in the staging
ELSEWHERE = 0x7F00_2000_0000


def test_engine_chain_has_one_copy_into_the_ids(runtime):
    nodes = count(runtime, (MEMCPY, IDS, 0, 0), (HOST, None, 0, 0), (KERNEL, None, 0, 0))
    assert nodes == {"memcpy": 1, "host": 1, "kernel": 1, "memcpy_to_ids": 1, "memcpy_other": 0}
    ref = count(runtime, (MEMCPY, IDS, 0, 0), (HOST, None, 0, 0), (MEMCPY, ELSEWHERE, 0, 0),
                (MEMCPY, ELSEWHERE + 4096, 0, 0))
    assert ref["memcpy"] == 3 and ref["memcpy_to_ids"] == 1 and ref["memcpy_other"] == 2
    r = nodes_row("cached-chain nodes vllm", nodes, "", ref)
    assert r["status"] == "ok" and r["value"] == "host 1, kernel 1, memcpy 1", r
    assert "1 into the job's ids, 0 elsewhere" in r["note"] and "host 1, memcpy 3" in r["note"]


def test_a_copy_node_or_a_missing_host_node_fails(runtime):
    ref = {"memcpy": 3, "host": 1, "memcpy_to_ids": 1, "memcpy_other": 2}
    copy_chain = count(runtime, (MEMCPY, IDS, 0, 0), (HOST, None, 0, 0), (KERNEL, None, 0, 0),
                       (MEMCPY, ELSEWHERE, 0, 0))
    assert nodes_row("n", copy_chain, "", ref)["status"] == "FAIL"
    no_host = count(runtime, (MEMCPY, IDS, 0, 0), (KERNEL, None, 0, 0))
    assert nodes_row("n", no_host, "", ref)["status"] == "FAIL"
    good = {"memcpy": 1, "host": 1, "kernel": 1, "memcpy_to_ids": 1, "memcpy_other": 0}
    assert nodes_row("n", good, "", {"memcpy": 1})["status"] == "FAIL"  # a counter that misses copies proves nothing
    assert nodes_row("n", None, "torch has no keep_graph", None)["status"] == "skipped"


def test_copy_destination_with_an_offset_and_unreadable_parameters(runtime):
    offset = count(runtime, (MEMCPY, IDS - 512, 512, 0), (HOST, None, 0, 0))
    assert offset["memcpy_to_ids"] == 1 and offset["memcpy_other"] == 0
    unread = count(runtime, (MEMCPY, IDS, 0, 1), (KERNEL, None, 0, 0))
    assert unread["memcpy"] == 1 and unread["memcpy_to_ids"] == -1 and unread["memcpy_other"] == -1
    assert "destination not read" in nodes_row("n", unread, "", {"memcpy": 3})["note"]


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="util-linux findmnt is not installed")
@pytest.mark.parametrize("where", ["tmp", "/dev/shm", "/proc/self"])
def test_filesystem_is_the_one_findmnt_names(where, tmp_path):
    path = tmp_path if where == "tmp" else Path(where)
    if not path.exists():
        pytest.skip(f"{path} does not exist here")
    want = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "--target", str(path)], capture_output=True,
                          text=True, check=True).stdout.split()
    got = filesystem(path)
    assert [got.type, got.mountpoint] == want[:2]
    if where == "/dev/shm":
        assert got.type in MEMORY_FS


def test_host_lanes_keep_stream_order():
    """A side lane runs its work in order, ``after`` waits for another lane's earlier work, ``wait`` for a
    span; the main lane runs at once."""
    lanes = HostLanes()
    try:
        side, other = lanes.lane("a"), lanes.lane("b")
        order: list[str] = []
        gate = threading.Event()
        slow = side.run(lambda: (gate.wait(5), order.append("side")))
        other.after(side)
        other.run(lambda: order.append("other"))
        main = lanes.main.run(lambda: order.append("main"))  # not behind the side lanes
        assert order == ["main"] and main.ms() >= 0
        gate.set()
        lanes.main.wait(slow)
        lanes.sync()
        assert order == ["main", "side", "other"]
        failing = side.run(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            lanes.sync()
        assert failing.done.is_set()
        t = side.run(lambda: time.sleep(0.01))
        lanes.sync()
        assert t.ms() >= 10
    finally:
        lanes.close()
