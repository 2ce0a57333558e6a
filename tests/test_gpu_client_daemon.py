"""EngramPrefetcher through a real daemon (unix://), every path, rows byte-exact against the reference reader."""

from __future__ import annotations

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess
from test_gpu_client_prefetch import Reference, check

from engram_store import TableSet, get_spec
from gpu_client import EngramClient, EngramPrefetcher, Step

SPEC = get_spec("tiny")


@pytest.fixture(scope="module")
def tables(tiny_tables):
    return tiny_tables(seed=9)


@pytest.fixture(scope="module", params=[("1GiB", []), ("64KiB", []), ("5MiB", ["--placement", "1=resident,3=cached"])],
                ids=["resident", "cached", "mixed"])
def daemon(request, tables, tmp_path_factory):
    dram, extra = request.param
    with DaemonProcess(tables[0], tmp_path_factory.mktemp("daemon"), dram_bytes=dram, extra=extra) as d:
        yield d


def churn(pf: EngramPrefetcher, ts: TableSet, seed: int, max_len: int) -> None:
    """Prefill chunks, decode steps, requests joining and finishing, the next step submitted before consuming."""
    ref = Reference(ts)
    rng = np.random.default_rng(seed)
    steps, active, next_id = [], [], 0
    for _ in range(25):
        while len(active) < 5:
            active.append(next_id)
            next_id += 1
        batch = [r for r in active if rng.random() < 0.8]
        toks = [rng.integers(-1, SPEC.compressed_vocab, size=int(rng.integers(0, max_len if r >= next_id - 2 else 3)))
                for r in batch]
        finished = [r for r in batch if rng.random() < 0.2]
        steps.append(Step.from_lists(batch, toks, finished=finished))
        active = [r for r in active if r not in finished]
    expected = [ref.step(s) for s in steps]
    futs = [pf.submit(steps[0])]
    for k in range(len(steps)):
        if k + 1 < len(steps):
            futs.append(pf.submit(steps[k + 1]))
        check(futs[k], expected[k])


@pytest.mark.parametrize("kwargs", [dict(resident=False), dict(resident=False, prefetch=False), dict(),
                                    dict(resident=False, depth=3)], ids=["staged", "lazy", "auto", "depth3"])
def test_churn_through_the_daemon(daemon, tables, kwargs):
    with EngramClient.connect(daemon.unix) as client:
        with EngramPrefetcher(client, max_tokens=128, **kwargs) as pf:
            mode = client.info()["mode"]
            arena = kwargs.get("resident") is not False and mode != "cached"
            want = {"resident": "resident-cpu", "mixed": "resident-cpu+staged"}[mode] if arena else "staged"
            assert pf.path == want and pf.info()["path"] == want
            if mode == "mixed" and arena:  # layer 1 gathered from the mapped arena, layer 3 looked up
                assert pf.info()["placement"] == {1: "resident", 3: "lookup"}
            if want.endswith("staged"):
                assert pf.info()["lookups"] == ("async-submit" if pf.prefetch else "on-wait")
            churn(pf, tables[1], seed=len(kwargs), max_len=30)


def test_steps_too_big_for_the_region_go_through_the_thread(daemon, tables):
    """A small shared region: big prefill steps fall back to background lookup_into, small ones stay async."""
    with EngramClient.connect(daemon.unix, shm_bytes=256 << 10) as client:
        with EngramPrefetcher(client, max_tokens=512, resident=False) as pf:
            assert 0 < pf._async_rows < 60 * SPEC.rows_per_token
            churn(pf, tables[1], seed=7, max_len=100)


def test_grpc_client_uses_the_thread(daemon, tables):
    with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as client:
        with EngramPrefetcher(client, max_tokens=64) as pf:
            assert pf.path == "staged" and not pf._async
            churn(pf, tables[1], seed=3, max_len=20)
