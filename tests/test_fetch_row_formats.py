"""The engines' fetch job for every row format the daemon serves: Qwen4Exp's FP8 rows with one table scale
(160 B, no block scales), its BF16 (320 B) and NVFP4 rows (80 B + 10 E4M3 block scales), LongCat's BF16 rows
(512 B), each table cached behind a cache far smaller than it. Every step is served by the daemon into the
job's staging (none read the files directly), the rows equal ``TableSet.read_rows`` split into the payload and
scale blocks, and the daemon read rows from NVMe."""

from __future__ import annotations

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess

from engram_store.fetch.job import FetchJob
from engram_store.models.spec import get_spec

SPECS = [("qwen3.8-flash-next", 0.0005), ("qwen3.8-flash-next-bf16", 0.0005), ("qwen3.8-flash-next-nvfp4", 0.0005),
         ("longcat-flash-lite", 0.001)]
STEPS, STEP_ROWS = 6, 64 * 16


@pytest.mark.parametrize("name, scale", SPECS, ids=[name for name, _ in SPECS])
def test_a_cached_table_without_v41s_row_is_fetched_through_the_daemon(flash_tables, tmp_path, name, scale):
    from engram_store.client.client import EngramClient

    spec = get_spec(name, scale)
    tables = flash_tables(seed=7, spec=spec)
    layer, width = spec.layers[0], spec.row_format.payload_bytes
    with DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB") as daemon:
        assert daemon.ready["mode"] == "cached"
        job = FetchJob(daemon.unix, layer, STEP_ROWS, hedge=2.0)  # no hedging: every step from the daemon
        try:
            assert job.connected
            for step in range(STEPS):
                ids = np.random.default_rng(step).integers(0, spec.rows(layer), STEP_ROWS)
                ids[: step % 3] = -1  # padded positions: zero rows
                job.ids[: ids.size] = ids
                job.run(ids.size)
                want = np.zeros((ids.size, spec.row_bytes), np.uint8)
                want[ids >= 0] = tables.read_rows(layer, ids[ids >= 0])
                np.testing.assert_array_equal(job.weight[: ids.size], want[:, :width])
                np.testing.assert_array_equal(job.scales[: ids.size].reshape(ids.size, -1), want[:, width:])
            job.raise_if_failed()
            stats = job.stats()
            assert stats["daemon_steps"] == STEPS and stats["direct_steps"] == 0, stats
        finally:
            job.close()
        with EngramClient.connect(daemon.unix) as client:
            store = client.stats()
    assert sum(v for k, v in store.items() if "rows_nvme" in k or "nvme_rows" in k) > STEP_ROWS, store
