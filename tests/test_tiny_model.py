"""The tiny Engram model end to end: logits bitwise identical with in-process tables and through the daemon."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.daemon_helpers import DaemonProcess

from engram_store import get_spec
from engram_store.tools.synth import write_synthetic
from gpu_client import EngramClient, EngramPrefetcher, LocalClient
from gpu_client.examples.tiny_engram import TinyConfig, TinyEngramModel, decode, main, prefill, prompt_chunks

SPEC = get_spec("tiny")
CONFIG = TinyConfig(hidden=64, blocks=4, heads=4, mlp=128, seed=5)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "tiny"
    write_synthetic(path, SPEC, seed=21)
    return path


def run(client, **kwargs) -> list[torch.Tensor]:
    """Prefill 6 requests in chunks (two requests per chunk), then 5 greedy decode steps."""
    torch.manual_seed(0)
    with EngramPrefetcher(client, max_tokens=64, **kwargs) as pf:
        model = TinyEngramModel(pf.spec, CONFIG)
        logits = list(prefill(model, pf, prompt_chunks(pf.spec, 6, 20, 40, seed=1), lookahead=pf.prefetch))
        logits += list(decode(model, pf, [f"p{r}" for r in range(6)], np.arange(6) * 7, 5))
        assert pf.active_requests == 0  # the last decode step finished every request
    return logits


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # bitwise, NaN-proof


@pytest.fixture(scope="module")
def local_logits(tables):
    with LocalClient.open(tables) as client:
        return run(client, resident=False)


def test_logits_are_finite_and_depend_on_the_tables(local_logits, tmp_path):
    assert all(torch.isfinite(x).all() for x in local_logits)
    other = tmp_path / "other"
    write_synthetic(other, SPEC, seed=22)
    with LocalClient.open(other) as client:
        changed = run(client, resident=False)
    assert not torch.equal(changed[0], local_logits[0])


@pytest.mark.parametrize("kwargs", [dict(resident=True), dict(prefetch=False, resident=False)],
                         ids=["resident-cpu", "no-prefetch"])
def test_paths_in_process_agree(local_logits, tables, kwargs):
    with LocalClient.open(tables) as client:
        assert_identical(run(client, **kwargs), local_logits)


@pytest.mark.parametrize("dram_bytes", ["1GiB", "64KiB"], ids=["resident-daemon", "cached-daemon"])
def test_logits_identical_through_the_daemon(local_logits, tables, tmp_path, dram_bytes):
    with DaemonProcess(tables, tmp_path, dram_bytes=dram_bytes) as daemon:
        with EngramClient.connect(daemon.unix) as client:
            for kwargs in (dict(resident=False), dict(prefetch=False, resident=False), dict()):
                assert_identical(run(client, **kwargs), local_logits)
            with EngramPrefetcher(client) as pf:
                assert pf.path == ("resident-cpu" if client.info()["mode"] == "resident" else "staged")


def test_example_script_prints_the_same_digest(tables, tmp_path, capsys):
    main(["--tables", str(tables), "--requests", "2", "--prompt", "8", "--decode", "2"])
    local = capsys.readouterr().out
    with DaemonProcess(tables, tmp_path) as daemon:
        main(["--daemon", daemon.unix, "--requests", "2", "--prompt", "8", "--decode", "2"])
    through_daemon = capsys.readouterr().out
    assert '"logits_sha256"' in local
    assert local.split('"logits_sha256"')[1] == through_daemon.split('"logits_sha256"')[1]
