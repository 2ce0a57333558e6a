"""The client's transport seam: both transports have every member of the ``Transport`` protocol, and
``EngramClient`` never asks which transport it holds (no ``kind`` comparison, no ``hasattr``)."""

from __future__ import annotations

import ast
import inspect

import pytest

from engram_store.client import client as client_module
from engram_store.client.grpc_transport import GrpcTransport
from engram_store.client.transport import Finished, Transport
from engram_store.client.unix_pending import UnixPending
from engram_store.client.unix_transport import UnixTransport


def protocol_members() -> set[str]:
    return {m for m in vars(Transport) if not m.startswith("_")} | set(Transport.__annotations__)


def instance_attributes(cls: type) -> set[str]:
    """Names ``cls`` assigns as ``self.NAME`` anywhere in its methods."""
    tree = ast.parse(inspect.getsource(cls))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


@pytest.mark.parametrize("cls", [UnixTransport, GrpcTransport])
def test_each_transport_has_every_member_of_the_protocol(cls):
    missing = {m for m in protocol_members() if not hasattr(cls, m)} - instance_attributes(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of Transport"


@pytest.mark.parametrize("cls", [UnixPending, Finished])
def test_each_pending_lookup_waits_and_releases(cls):
    assert callable(getattr(cls, "wait")) and callable(getattr(cls, "release"))


def test_the_client_never_asks_which_transport_it_holds():
    tree = ast.parse(inspect.getsource(client_module))
    asks = [ast.unparse(node) for node in ast.walk(tree)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"))
            or (isinstance(node, ast.Compare) and any(isinstance(s, ast.Attribute) and s.attr == "kind"
                                                      for s in [node.left, *node.comparators]))]
    assert asks == []


def test_a_finished_lookup_returns_its_rows():
    rows = object()
    done = Finished(rows)  # type: ignore[arg-type]
    assert done.wait() is rows and done.wait() is rows
    done.release()
