"""A fetch job's direct reads against table files changed under it, with the daemon down: another
table set's files copied over, the checksum file truncated (which raised SIGBUS through a shared
mapping), a file replaced by rename. Each is a clear error naming layer and file, its rows zero and
never the other table set's; an honest job on intact files still gets exact bytes (compared with
``TableSet.read_rows``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, make_tables

from engram_store import errors
from engram_store.fetch.job import FetchJob
from engram_store.format.manifest import Manifest

LAYER = 3  # the tiny spec's second layer, cached behind a tiny cache
ROWS = 1500


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    return make_tables(root / "A", seed=31), make_tables(root / "B", seed=32)


@pytest.fixture
def copy_a(sets, tmp_path):
    """A private copy of table set A (the attacks write to it)."""
    shutil.copytree(sets[0].directory, tmp_path / "A")
    return tmp_path / "A"


@contextmanager
def job_without_daemon(directory, workdir) -> Iterator[FetchJob]:
    """A job made on a daemon serving ``directory``, the daemon then killed: steps read directly."""
    with DaemonProcess(directory, workdir, dram_bytes="256KiB") as d:
        job = FetchJob(d.unix, LAYER, 2048, deadline=5)
    try:
        yield job
    finally:
        job.close()


def step(job: FetchJob, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, job.layer_rows, ROWS)
    job.ids[:ROWS] = ids
    job.run(ROWS)
    return ids


def rows(job: FetchJob) -> np.ndarray:
    return np.concatenate([job.weight[:ROWS], job.scales[:ROWS]], 1)


def step_is_refused(job: FetchJob, seed: int, match: str) -> None:
    """A step of ``job`` fails with a StorageError matching ``match``, its rows zero."""
    step(job, seed)
    with pytest.raises(errors.StorageError, match=match):
        job.raise_if_failed()
    assert not rows(job).any()


def honest_job_is_exact(tables, workdir, seed: int) -> None:
    """A job on ``tables``' intact files (its daemon down too) reads exact rows."""
    with job_without_daemon(tables.directory, workdir) as honest:
        ids = step(honest, seed)
        honest.raise_if_failed()
        np.testing.assert_array_equal(rows(honest), tables.read_rows(LAYER, ids))


def files_of(directory) -> tuple[str, str]:
    entry = Manifest.load(directory).layer(LAYER)
    return entry.file, entry.crc_file


def test_files_of_another_table_set_copied_over_are_refused_naming_layer_and_file(sets, copy_a, tmp_path):
    a, b = sets
    with job_without_daemon(copy_a, tmp_path) as job:
        ids = step(job, 1)
        job.raise_if_failed()
        np.testing.assert_array_equal(rows(job), a.read_rows(LAYER, ids))
        data, crc = files_of(copy_a)
        for name in (data, crc):  # cp B/layer_003.{bin,crc} A/: written in place, same size
            shutil.copyfile(b.directory / name, copy_a / name)
        step_is_refused(job, 2, rf"layer {LAYER}: its table file {copy_a}/{data} was written")  # never B's rows
        assert job.stats()["failed_steps"] == 1
    honest_job_is_exact(b, tmp_path, seed=3)


def test_a_truncated_checksum_file_is_an_error_not_a_signal(sets, copy_a, tmp_path):
    a, _ = sets
    with job_without_daemon(copy_a, tmp_path) as job:
        _, crc = files_of(copy_a)
        os.truncate(copy_a / crc, 0)  # a shared mapping of it would raise SIGBUS at the next page check
        step_is_refused(job, 4, rf"layer {LAYER}: its checksum file {copy_a}/{crc} changed size")
        step_is_refused(job, 5, "changed size")  # every later direct step too, never a signal
    honest_job_is_exact(a, tmp_path, seed=6)


def test_a_table_file_replaced_by_rename_is_refused(sets, copy_a, tmp_path):
    _, b = sets
    with job_without_daemon(copy_a, tmp_path) as job:
        data, _ = files_of(copy_a)
        shutil.copyfile(b.directory / data, copy_a / "new.bin")
        os.replace(copy_a / "new.bin", copy_a / data)  # a new inode at the path the job opened
        step_is_refused(job, 7, rf"{copy_a}/{data} was replaced since the engine opened it")
