"""Where the plugin's Engram work runs: CUDA streams on a GPU, the calling thread on a CPU.

A chain (:mod:`.chain`) issues three kinds of work, each on a :class:`Lane`: torch work (the ids'
copy into a fetch job, SGLang's ``engram_gather``), a fetch job's run (a CUDA host function on a
GPU, which CUDA graphs capture as a host node) and markers that order one lane after another
(CUDA events). Per device there are two side lanes shared by every Engram layer of the process,
``fetch`` (the ids' copies and the jobs' runs) and ``gather`` (the gathers), and the ``main`` lane,
the stream the model runs on when the chain is issued.

On a CPU every lane runs its work at once, in the order it is issued: whatever order a chain
issues its work in is the order it runs, so an issue order that is wrong on a GPU (a refill before
the gather that reads the staging) gives wrong rows on a CPU too. Tests put lanes of their own in
(:func:`for_device` is looked up at each use) to run the same issue order the way streams may.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ...fetch.job import FetchJob


class Lane(Protocol):
    """One in-order stream of work. Work issued on a lane runs after the work issued on it before;
    across lanes only markers order it. Single-threaded use (a model's forward)."""

    def run(self, fn: Callable[[], object]) -> None:
        """Issue torch work: ``fn`` enqueues it (on a GPU inside ``torch.cuda.stream``)."""

    def fetch(self, job: FetchJob, rows: int) -> None:
        """Issue ``job``'s run over its first ``rows`` ids (a CUDA host function on a GPU)."""

    def record(self) -> Any:
        """A marker of the work issued on this lane so far (``None`` on a CPU: it has run)."""

    def wait(self, marker: Any) -> None:
        """Work issued after this waits for ``marker``'s work (``None``: nothing to wait for)."""

    def keep(self, tensor: Any) -> None:
        """``tensor``'s memory stays allocated until the work issued on this lane so far is done."""


@dataclass(frozen=True)
class Lanes:
    main: Lane
    fetch: Lane
    gather: Lane


class CpuLane:
    """A lane that runs its work when it is issued."""

    def run(self, fn: Callable[[], object]) -> None:
        fn()

    def fetch(self, job: FetchJob, rows: int) -> None:
        job.run(rows)

    def record(self) -> None:
        return None

    def wait(self, marker: Any) -> None:
        return None

    def keep(self, tensor: Any) -> None:
        return None


class CudaLane:
    """A CUDA stream (events as markers; inside a CUDA graph capture all of it is captured)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def run(self, fn: Callable[[], object]) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            fn()

    def fetch(self, job: FetchJob, rows: int) -> None:
        job.launch_host(self.stream.cuda_stream, rows)

    def record(self) -> Any:
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, marker: Any) -> None:
        if marker is not None:
            self.stream.wait_event(marker)

    def keep(self, tensor: Any) -> None:
        tensor.record_stream(self.stream)


_CPU_LANE = CpuLane()
CPU = Lanes(_CPU_LANE, _CPU_LANE, _CPU_LANE)
_side: dict[str, tuple[CudaLane, CudaLane]] = {}  # device -> (fetch, gather), made on first use


def for_device(device: Any) -> Lanes:
    """The lanes of ``device`` (a torch device): its current stream as ``main``."""
    if device.type != "cuda":
        return CPU
    import torch

    side = _side.get(str(device))
    if side is None:
        side = _side[str(device)] = (CudaLane(torch.cuda.Stream(device)), CudaLane(torch.cuda.Stream(device)))
    return Lanes(CudaLane(torch.cuda.current_stream(device)), *side)
