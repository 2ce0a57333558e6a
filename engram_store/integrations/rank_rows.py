"""One table's rows as one tensor-parallel rank serves them to an engine's own lookup.

The engines shard an n-gram table (Qwen4Exp's PLE table, LongCat's n-gram tables) over their ranks by
contiguous row ranges and look rows up with a masked embedding: an id outside the rank's range gives a
zero row, and an all-reduce sums the ranks' rows. :class:`RankRows` is the rank's range ``[start, end)``
and, for a cached table, the fetch job whose staging stands in for the rank's rows: each step the ids
the rank owns are fetched into staging rows ``0..n-1`` (the others as :data:`DEAD_ID`, zero rows), and
the engine's lookup reads the staging with the positional ids ``start + i`` that :meth:`RankRows.fetch`
returns, so its mask and all-reduce run unchanged. :func:`built_on_meta` builds such a table's own
weight without memory while the engine constructs it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import EngineUnsupported
from .tables import EngramStoreTables

DEAD_ID = -1  # an id this rank does not own: its fetch job writes a zero row


@dataclass
class RankRows:
    """One rank's rows ``[start, end)`` of ``layer``'s table, and for a cached table its fetch job."""

    what: str  # the table, as error messages name it ("PLE layer 1", "LongCat n-gram table")
    layer: int
    tables: EngramStoreTables
    start: int
    end: int
    job: Any = None  # a cached table's FetchJob
    ids: Any = None  # torch int64 [max_rows] over the job's ids
    positions: dict = field(default_factory=dict)  # device -> int64 [max_rows]: start + i (a stable address)

    def owned(self, ids: Any) -> Any:
        """``ids`` where this rank owns them, else the dead id."""
        import torch

        return torch.where((ids >= self.start) & (ids < self.end), ids, DEAD_ID)

    def fetch(self, ids: Any, limit: str, now: bool = False) -> Any:
        """A cached table's rows of ``ids`` into the staging (this rank's; the others zero rows) and the
        positional ids, shaped as ``ids``, that the engine's lookup reads the staging with. On a GPU the job
        is queued on the ids' stream, after their copy to the host (a host function: CUDA graphs capture
        it), unless ``now``; on the CPU, or with ``now``, it runs before this returns. ``limit`` names the
        engine settings that size the staging (for the error of a step larger than it)."""
        import torch

        n = ids.numel()
        if n > self.job.max_rows:
            raise EngineUnsupported(f"{self.what}: a step of {n} row ids, the staging holds {self.job.max_rows} "
                                    f"({limit})")
        queued = ids.is_cuda and not now
        self.ids[:n].copy_(self.owned(ids.reshape(-1)), non_blocking=queued)
        if queued:
            self.job.launch_host(torch.cuda.current_stream(ids.device).cuda_stream, n)
        else:
            self.job.run(n)  # after a blocking copy: the stream's reads of the last step's staging are done
        key = str(ids.device)
        if key not in self.positions:
            self.positions[key] = (self.start + torch.arange(self.job.max_rows)).to(ids.device)
        return self.positions[key][:n].view(ids.shape)


_meta_lock = threading.Lock()


@contextlib.contextmanager
def built_on_meta(module: Any, rows: int | None = None, dim: int | None = None) -> Iterator[None]:
    """While open, ``module.VocabParallelEmbedding`` builds its tables on the meta device (their rows are
    the daemon's: nothing is allocated); with ``rows`` and ``dim``, only a table of that shape, others
    (a word embedding) where the engine puts them. One such patch at a time in a process."""
    import torch

    real = module.VocabParallelEmbedding

    def on_meta(num_embeddings, embedding_dim, *args, **kwargs):
        if rows is not None and (int(num_embeddings), int(embedding_dim)) != (rows, dim):
            return real(num_embeddings, embedding_dim, *args, **kwargs)
        with torch.device("meta"):
            return real(num_embeddings, embedding_dim, *args, **kwargs)

    with _meta_lock:
        module.VocabParallelEmbedding = on_meta
        try:
            yield
        finally:
            module.VocabParallelEmbedding = real
