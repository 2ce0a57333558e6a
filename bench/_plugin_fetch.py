"""bench/engine_step.py's fetch for the tables the vLLM plugin serves through ``staging_job``: Qwen4Exp's PLE
table (``engram_store/integrations/vllm/qwen4exp.py``) and LongCat-Flash's n-gram table (``.../longcat.py``).

The plugin connects :class:`~engram_store.integrations.tables.EngramStoreTables` to the daemon, takes a fetch job
from it (``tables.fetch_job(layer, rows)``: the tables' identity, its own staging), and at each step copies the
step's row ids into the job's ids, those its rank owns as they are and the others as the dead id ``-1`` (zero
rows), runs the job, and hands vLLM's lookup the positional ids ``start + i``: row ``i`` of the staging is the
``i``-th id. Failures are raised at the step's host-visible point (``tables.check_fetches()``). :class:`PluginJob`
runs the plugins' own fetch (``engram_store.integrations.rank_rows.RankRows``), with the fetch job's interface the bench's stepper drives (``ids``, ``run``, ``weight``/``scales``,
``raise_if_failed``, ``stats``, ``close``).

One difference from an engine, as for the bench's V4.1 fetch job: the hedge budget is the deadline
(``ENGRAM_STORE_FETCH_HEDGE_SECONDS`` while the job is made), so the job never also reads pages itself while the
daemon may answer; the steps measured are the daemon's.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engram_store.integrations.rank_rows import RankRows

PLUGIN_FAMILIES = ("Qwen4Exp PLE n-gram", "LongCat-Flash n-gram")  # spec.family of the tables fetched so
PATH = "vLLM plugin: EngramStoreTables.fetch_job, the rank's rows by position"


def fetched_like_the_plugin(spec) -> bool:
    """True for the families whose cached table the plugin fetches through ``staging_job`` (Qwen4Exp, LongCat)."""
    return spec is not None and spec.family in PLUGIN_FAMILIES


class PluginJob:
    """One rank's fetch job of cached ``layer`` as the plugin makes and drives it: rows ``[start, end)`` are the
    rank's (default: the whole table, one rank), the others fetched as dead ids."""

    def __init__(self, address: str, layer: int, max_rows: int, deadline: float, start: int = 0,
                 end: int | None = None) -> None:
        from engram_store.fetch.job import DEADLINE_ENV, HEDGE_ENV
        from engram_store.integrations.tables import EngramStoreTables

        self.tables = EngramStoreTables.connect(address)
        saved = {k: os.environ.get(k) for k in (DEADLINE_ENV, HEDGE_ENV)}
        os.environ[DEADLINE_ENV] = os.environ[HEDGE_ENV] = str(deadline)
        try:
            self.job = self.tables.fetch_job(layer, max_rows)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.start, self.end = start, self.tables.rows(layer) if end is None else end
        self.rank = RankRows(f"layer {layer}", layer, self.tables, self.start, self.end, self.job,
                             self.tables.job_tensors(self.job)[0])
        self.ids = np.zeros(self.job.max_rows, dtype=np.int64)  # the step's ids, as the engine hands them
        self.weight, self.scales = self.job.weight, self.job.scales  # the staging, read by position

    def run(self, n: int) -> None:
        """The plugins' own fetch (``RankRows.fetch``) on the CPU: the rank's ids into the job's (others dead),
        the job run now."""
        self.rank.fetch(torch.from_numpy(self.ids[:n]), "the bench's rows a step")

    def raise_if_failed(self) -> None:
        self.tables.check_fetches()

    def stats(self) -> dict:
        return self.job.stats() | {"path": PATH, "rank_rows": [self.start, self.end]}

    def close(self) -> None:
        self.job.close()
