"""Where a cached layer's fetch failures stop vLLM: the points at which a step's sampled tokens become
host-visible, in both of vLLM's model runners.

A cached layer's rows are fetched by a host function inside the step (on a GPU, possibly inside a
replayed CUDA graph, where no Python of ours runs). A page that fails its checksum with no good copy
leaves its rows zero and is recorded by the fetch job (and on the failure board every rank shares,
:mod:`..failures`). Tokens sampled from such a step must never reach a client, so the failure is raised:

* after ``sample_tokens`` (V1's ``GPUModelRunner`` and V2's ``vllm.v1.worker.gpu.model_runner.
  GPUModelRunner``, the default of vLLM 0.33) when it returns a host-side ``ModelRunnerOutput``
  (V1 without async scheduling: its tokens were synchronized to the host in it), and after
  ``execute_model`` (V1 returns outputs there too);
* after ``get_output`` of the runners' asynchronous outputs (V1's ``AsyncGPUModelRunnerOutput``, V2's
  ``AsyncOutput``): it waits for the step's device-to-host copies, which follow the step's sampling,
  which follows its Engram layers and so its fetches. The failure raises before the tokens are
  returned, so vLLM's engine core stops without emitting them (``LLM.generate`` returns nothing,
  ``AsyncLLM`` streams none of that step's tokens).

Every rank of the batch must stop, not only the one whose fetch failed (:mod:`..agreement`): ranks
sharing a failure board read it at those points; ranks that do not (other nodes, Ray,
``external_launcher``) *settle* each step at the entry of ``sample_tokens``, which every rank runs
(vLLM's executors broadcast it): each waits for its step's device work, then they agree over vLLM's
CPU groups (:mod:`.ranks`), before sampling, before PP broadcasts and before any KV connector is
handed the step's KV. A KV connector's ``wait_for_save`` settles the step in every mode
(:mod:`.kv_gate`). Nothing is checked inside the forward: a rank leaving it early would leave its
peers waiting in the model's collectives.

``execute_model`` also begins a step (it is settled anew) and hints the step's new prompts to the
daemon first (:mod:`.prompt_hints`).

A failure is sticky: once seen, every later check raises it again (the engine is stopping; a second
thread's check must not find a cleared error and let tokens through).

The runner that builds a model holding a cached layer must be one whose output points are checked:
``load_model`` of the runners the plugin knows sets the runner for the build, and a cached layer built
under no runner, or under one whose ``sample_tokens`` / ``execute_model`` are not the checked ones (a
subclass overriding them), is refused at model build, naming it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
from typing import Any, Callable, Iterator

from ...errors import EngineUnsupported, EngramStoreError, StorageError
from .. import agreement, failures
from . import kv_gate, prompt_hints, ranks

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
V2_ASYNC = "vllm.v1.worker.gpu.async_utils"
V1_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"  # vLLM's CPU runner (V1): its own load_model
CHECKED = "_engram_store_checked"  # set on our wrappers: what a runner's output methods must resolve to
OUTPUT_METHODS = ("execute_model", "sample_tokens")

_runner: contextvars.ContextVar[Any] = contextvars.ContextVar("engram_store_runner", default=None)
_failure_lock = threading.Lock()
_failure: EngramStoreError | None = None
_settled = True  # this step's fetches were settled (begin_step clears it)


def targets(module: Callable[[str], Any], attr: Callable[[Any, str], Any], tables) -> dict:
    """The runner patches, for patches._targets: key -> (owner, name, make(original))."""
    v1, v2 = attr(module(V1_RUNNER), "GPUModelRunner"), attr(module(V2_RUNNER), "GPUModelRunner")
    out = {}
    for tag, runner in (("v1", v1), ("v2", v2)):
        out[f"execute_model_{tag}"] = (runner, "execute_model",
                                       lambda original: _checked_output(original, tables, hinted=True))
        out[f"sample_tokens_{tag}"] = (runner, "sample_tokens", lambda original: _checked_output(original, tables))
        out[f"load_model_{tag}"] = (runner, "load_model", _building)
    out["get_output_v1"] = (attr(module(V1_RUNNER), "AsyncGPUModelRunnerOutput"), "get_output",
                            lambda original: _checked_get_output(original, tables))
    out["get_output_v2"] = (attr(module(V2_ASYNC), "AsyncOutput"), "get_output",
                            lambda original: _checked_get_output(original, tables))
    cpu = attr(module(V1_CPU_RUNNER), "CPUModelRunner")
    if "load_model" in vars(cpu):  # it builds the model itself, without GPUModelRunner.load_model
        out["load_model_cpu"] = (cpu, "load_model", _building)
    return out


def _mark(fn: Callable) -> Callable:
    setattr(fn, CHECKED, True)
    return fn


def _checked_output(original, tables, hinted: bool = False):
    """``execute_model`` (``hinted``: a new step: its scheduler output's new prompts are hinted first, see
    prompt_hints.py) or ``sample_tokens`` (the ranks settle the step first where they share no board), then
    the check."""
    def checked(self, *args, **kwargs):
        if hinted:
            begin_step(tables)
            if args and not kwargs.get("dummy_run"):
                prompt_hints.on_step(tables, args[0])
        elif ranks.mode() is agreement.Mode.AGREE:
            settle(tables)  # every rank runs sample_tokens: before its tokens, PP broadcasts and KV saves
        result = original(self, *args, **kwargs)
        check(tables)  # a ModelRunnerOutput's tokens are on the host now; an async one is checked again below
        return result

    checked.__name__ = getattr(original, "__name__", "checked")
    return _mark(checked)


def _checked_get_output(original, tables):
    def get_output(self):
        output = original(self)  # waits for the step's copies, so for its fetches
        check(tables)
        return output

    return _mark(get_output)


def _building(original):
    def load_model(self, *args, **kwargs):
        _new_engine()
        with model_runner(self):
            return original(self, *args, **kwargs)

    return load_model


@contextlib.contextmanager
def model_runner(runner: Any) -> Iterator[None]:
    """Models built in this block are built by ``runner`` (the patched ``load_model`` uses it)."""
    token = _runner.set(runner)
    try:
        yield
    finally:
        _runner.reset(token)


def require_checked_runner(layer: int) -> None:
    """Refuse a cached layer that the model runner building it would run unchecked."""
    runner = _runner.get()
    if runner is None:
        raise EngineUnsupported(
            f"Engram layer {layer} is cached (fetched per step), but this model is not being built by a vLLM model "
            "runner engram-store knows (V1 or V2 GPUModelRunner and their CPU runners): it could not check the "
            "layer's fetches before the step's tokens are returned; use vLLM's model runners, or give the layer "
            "DRAM on the daemon (placement resident)")
    cls = type(runner)
    for name in OUTPUT_METHODS:
        if not getattr(getattr(cls, name, None), CHECKED, False):
            raise EngineUnsupported(
                f"Engram layer {layer} is cached (fetched per step), but the model runner building it, "
                f"{cls.__module__}.{cls.__qualname__}, has its own {name} (engram-store checks a step's fetches "
                "there, in vLLM's V1 and V2 GPUModelRunner, before the step's tokens are returned): it is not "
                "supported with cached layers (give the layer DRAM on the daemon: placement resident)")


def check(tables) -> None:
    """Raise the first fetch failure of this process or of any rank on the failure board (sticky). Where
    the ranks agree per step only an agreed failure is raised here: a rank raising its own failure alone,
    outside the settle, would leave its peers in the settle's collective."""
    if _failure is not None:
        raise copy.copy(_failure)
    if ranks.known() is agreement.Mode.AGREE:
        return
    local = _local_failure(tables)
    if local is not None:
        raise _stick(local)


def _new_engine() -> None:
    """A model is built: an engine built in this process after a failed one starts clean (its own failure
    board where this process made the failed one's, the ranks surveyed anew)."""
    global _failure
    with _failure_lock:
        if _failure is None:
            return
        _failure = None
    failures.renew()
    ranks.reset()


def begin_step(tables) -> None:
    """A step begins (``execute_model``, on every rank): it is settled anew; the KV connector is gated."""
    global _settled
    _settled = False
    kv_gate.ensure(lambda: settle(tables), lambda: ranks.known() is agreement.Mode.NONE)


def settle(tables) -> None:
    """Once per step, on every rank at the same point (``sample_tokens`` where the ranks agree, the KV
    connector's ``wait_for_save``): wait for the step's fetches on this rank, then raise a failure of
    any rank sharing the batch (collectively where they share no failure board; sticky)."""
    global _settled
    if _failure is not None:
        raise copy.copy(_failure)
    mode = ranks.mode()
    if mode is agreement.Mode.NONE or _settled:
        return
    _wait_for_device()
    local = _local_failure(tables)
    try:
        if mode is agreement.Mode.AGREE:
            groups, rank = ranks.batch_groups()
            agreement.agree(local, groups, rank)
        elif local is not None:
            raise local
    except EngramStoreError as exc:
        raise _stick(exc)
    _settled = True


def _local_failure(tables) -> EngramStoreError | None:
    """This process's fetch jobs' first failure, else the failure board's (None: none)."""
    try:
        if ranks.has_cached():  # else this process runs no fetch job
            tables().check_fetches()
        failures.check()
    except EngramStoreError as exc:
        return exc
    return None


def _stick(exc: EngramStoreError) -> EngramStoreError:
    """Keep ``exc`` as this process's failure (the first one stays), on the board too; returns what to raise.

    What is kept is a copy without a traceback, and every later raise raises a copy of it: a traceback
    holds the frames it passed through (the agreement's, with the ranks' process groups), and a module
    global holding it would keep those groups alive past the engine's ``destroy_process_group`` until
    the interpreter's exit, where freeing a gloo group aborts the process."""
    global _failure
    with _failure_lock:
        if _failure is None:
            _failure = copy.copy(exc)
            if isinstance(exc, StorageError):
                failures.record(exc)  # for the other ranks, when the native write did not do it
            return exc
        return copy.copy(_failure)


def _wait_for_device() -> None:
    """Wait until this rank's device has run the step so far (its fetch host functions included)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
