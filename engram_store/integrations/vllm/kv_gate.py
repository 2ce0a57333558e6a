"""A vLLM KV connector saves or sends no KV of a step whose fetch failed.

KV computed from a cached layer's zero rows must not reach a KV store (LMCache, Mooncake, vLLM's
offloading connector: persistent, served to later requests, even after a restart) nor a P/D decode
instance. vLLM hands KV to its connector at two points of a step (both runners, vLLM 0.32 and 0.33):

* ``save_kv_layer``, from inside each attention layer during the forward (layer-wise connectors copy
  or send there); on a GPU the step's fetches may not even have run when it is called;
* ``wait_for_save``, once per step on every rank, after the forward (and the drafter's): connectors
  submit or finish their saves there, with the step's metadata still bound.

The gate wraps the worker's connector instance (the object ``get_kv_transfer_group()`` returns, so every
caller sees it): ``save_kv_layer`` calls are kept, in order, with their arguments (the KV cache they
name is not written again before the next step's forward); ``wait_for_save`` first settles the step
(``settle``: waits for its fetches and raises any rank's failure, :mod:`.runners`), then replays the
kept calls and calls the connector's own. A failed step raises there: nothing of it was handed to the
connector, and the engine stops. A layer-wise connector's saves thus run after the forward instead of
overlapping it, in a process serving a cached layer; once the ranks are known to serve none
(:data:`~..agreement.Mode.NONE`), calls pass straight through.

Connectors whose transfers the scheduler starts for finished requests (NIXL's P/D pull, the offloading
connector's block copies) act only on requests vLLM finished, after the step's output; a failed step
stops the engine before that.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

WRAPPED = "_engram_store_kv_gate"


class KVGate:
    """The wrappers of one connector instance (see the module docstring)."""

    def __init__(self, connector: Any, settle: Callable[[], None], passthrough: Callable[[], bool]) -> None:
        self.connector = connector
        self.save = connector.save_kv_layer
        self.wait = connector.wait_for_save
        self.settle = settle
        self.passthrough = passthrough
        self.kept: list[tuple[tuple, dict]] = []

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        if self.passthrough():
            return self.save(*args, **kwargs)
        self.kept.append((args, kwargs))
        return None

    def wait_for_save(self) -> Any:
        kept, self.kept = self.kept, []
        self.settle()  # raises for a failed step: its kept saves are dropped
        for args, kwargs in kept:
            self.save(*args, **kwargs)
        return self.wait()


def ensure(settle: Callable[[], None], passthrough: Callable[[], bool]) -> KVGate | None:
    """Gate this worker's KV connector, once (None when vLLM runs without one)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if not kv_transfer_state.has_kv_transfer_group():
        return None
    connector = kv_transfer_state.get_kv_transfer_group()
    gate = getattr(connector, WRAPPED, None)
    if gate is None:
        gate = KVGate(connector, settle, passthrough)
        connector.save_kv_layer = gate.save_kv_layer
        connector.wait_for_save = gate.wait_for_save
        setattr(connector, WRAPPED, gate)
        log.info("engram-store: vLLM's KV connector %s is handed a step's KV only once the step's fetches are known "
                 "exact on every rank", type(connector).__name__)
    return gate
