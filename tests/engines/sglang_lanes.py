"""Lanes that run issued work the way CUDA streams may (for tests/engines/sglang_engine_cached.py).

Each lane keeps its work in issue order; nothing runs when it is issued. :meth:`Streams.drain`
then runs one item at a time, from any lane whose next item is ready (a wait is ready once its
marker's record has run), the lane picked by a policy: ``round-robin`` interleaves the lanes item by
item, ``fetch-first`` / ``gather-first`` / ``main-first`` run that lane as far as it can go,
``random:SEED`` picks a ready lane at random at each item (a seeded schedule). Only
the markers a chain issues order one lane after another, as only events order CUDA streams: an
issue order that lets a refill overtake a gather gives wrong rows under some policy.
"""

from __future__ import annotations

import random
from collections import deque

from engram_store.integrations.sglang import chain
from engram_store.integrations.sglang.lanes import Lanes

POLICIES = ("round-robin", "fetch-first", "gather-first", "main-first", "random:0", "random:1", "random:2")
SCHEDULES = POLICIES + tuple(f"random:{seed}" for seed in range(3, 24))  # for the controls: more schedules


class Marker:
    def __init__(self) -> None:
        self.done = False


class QueuedLane:
    def __init__(self, streams: "Streams", name: str) -> None:
        self.streams, self.name, self.queue = streams, name, deque()

    def run(self, fn) -> None:
        self.queue.append(("run", fn))

    def fetch(self, job, rows: int) -> None:
        self.queue.append(("fetch", (job, rows)))

    def record(self) -> Marker:
        marker = Marker()
        self.queue.append(("record", marker))
        return marker

    def wait(self, marker) -> None:
        if marker is not None:
            self.queue.append(("wait", marker))

    def keep(self, tensor) -> None:
        return None

    def ready(self) -> bool:
        return bool(self.queue) and (self.queue[0][0] != "wait" or self.queue[0][1].done)


class Streams:
    """Three queued lanes (main, fetch, gather) and the log of what ran: ("fetch", job index, rows),
    ("gather", n) for the n-th gather and ("copy", n) for the n-th ids copy."""

    def __init__(self, policy: str, jobs=()) -> None:
        self.policy = policy
        self.main, self.fetch, self.gather = (QueuedLane(self, n) for n in ("main", "fetch", "gather"))
        self.lanes = Lanes(self.main, self.fetch, self.gather)
        self.jobs = list(jobs)
        self.log: list[tuple] = []
        self._turn = 0
        self._rng = random.Random(int(policy.split(":")[1])) if policy.startswith("random:") else None

    def _pick(self, ready: list[QueuedLane]) -> QueuedLane:
        if self._rng is not None:
            return self._rng.choice(ready)
        if self.policy == "round-robin":
            order = [self.main, self.fetch, self.gather]
            for i in range(3):
                lane = order[(self._turn + i) % 3]
                if lane in ready:
                    self._turn = (self._turn + i + 1) % 3
                    return lane
        first = {"fetch-first": self.fetch, "gather-first": self.gather, "main-first": self.main}[self.policy]
        return first if first in ready else ready[0]

    def drain(self) -> None:
        lanes = [self.main, self.fetch, self.gather]
        while any(lane.queue for lane in lanes):
            ready = [lane for lane in lanes if lane.ready()]
            if not ready:
                raise AssertionError(f"lanes wait on each other: {[(l.name, l.queue[0][0]) for l in lanes if l.queue]}")
            kind, what = self._pick(ready).queue.popleft()
            if kind == "record":
                what.done = True
            elif kind == "fetch":
                job, rows = what
                self.log.append(("fetch", self.jobs.index(job) if job in self.jobs else -1, rows))
                job.run(rows)
            elif kind == "run":
                name = {chain.gather: "gather", chain._copy_ids: "copy"}.get(getattr(what, "func", None), "run")
                self.log.append((name, sum(1 for entry in self.log if entry[0] == name)))
                what()

    def order(self, what: str) -> list[int]:
        """Positions in the log of the 1st, 2nd, ... entries of ``what``."""
        return [i for i, entry in enumerate(self.log) if entry[0] == what]
