"""The checked-in generated code is exactly what proto/generate.py produces, and it works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "engram_store" / "wire" / "_proto"


def test_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    produced = sorted(p.name for p in tmp_path.iterdir())
    assert produced == ["engram_store_pb2.py", "engram_store_pb2.pyi", "engram_store_pb2_grpc.py"]
    for name in produced:
        assert (tmp_path / name).read_text() == (GENERATED / name).read_text(), f"{name} is stale: run proto/generate.py"


def test_generated_code_works_with_the_installed_runtime():
    from engram_store.wire._proto import engram_store_pb2 as pb
    from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc

    req = pb.LookupRequest(layer=14, row_ids=b"\x01" * 16, dtype=pb.INT32)
    assert pb.LookupRequest.FromString(req.SerializeToString()) == req
    reply = pb.StatsReply(values={"unix_rows": 3.0})
    assert dict(pb.StatsReply.FromString(reply.SerializeToString()).values) == {"unix_rows": 3.0}
    assert hasattr(pb_grpc, "EngramStoreStub") and hasattr(pb_grpc, "add_EngramStoreServicer_to_server")


def test_service_implements_every_rpc_of_the_proto():
    """Every RPC of the proto is an async method of our service, of the streaming kind the
    proto declares, and none comes from the generated base (whose methods answer UNIMPLEMENTED)."""
    import inspect

    from engram_store.daemon.grpc.service import EngramStoreService
    from engram_store.wire._proto import engram_store_pb2 as pb
    from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc

    (service,) = pb.DESCRIPTOR.services_by_name.values()
    assert list(service.methods), "the proto declares no RPCs"
    assert not issubclass(EngramStoreService, pb_grpc.EngramStoreServicer)
    for method in service.methods:
        fn = inspect.unwrap(getattr(EngramStoreService, method.name, None) or (lambda: None))
        streams = method.server_streaming
        assert (inspect.isasyncgenfunction(fn) if streams else inspect.iscoroutinefunction(fn)), \
            f"{method.name}: expected an async {'generator' if streams else 'coroutine'} method, got {fn!r}"


def test_add_service_registers_every_rpc_and_refuses_a_missing_one():
    """The daemon registers its service from the proto's descriptor (not the generated base
    class, whose methods answer UNIMPLEMENTED): every RPC is wired, a missing one fails at start."""
    from engram_store.daemon.grpc.server import add_service
    from engram_store.daemon.grpc.service import EngramStoreService
    from engram_store.wire._proto import engram_store_pb2 as pb

    class Recorder:
        def __init__(self):
            self.handlers = {}

        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.handlers[name] = handlers

    (service,) = pb.DESCRIPTOR.services_by_name.values()
    server = Recorder()
    svc = EngramStoreService.__new__(EngramStoreService)
    add_service(svc, server)
    assert sorted(server.handlers[service.full_name]) == sorted(m.name for m in service.methods)

    class Incomplete:
        Lookup = LookupStream = Info = EngramStoreService.Info  # no Stats

    with pytest.raises(AttributeError, match="Stats"):
        add_service(Incomplete(), Recorder())
