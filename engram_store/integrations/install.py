"""The one install sequence of the engine plugins, and the state it hands every patch.

An engine plugin is an :class:`EngineAdapter` (what to check in the engine and what to patch there:
:mod:`.vllm.patches`, :mod:`.sglang.hooks`) and a :class:`~.models.ModelAdapter` (which tensors are the
tables and how the engine's config describes them: :mod:`.models`). :func:`install` runs the same steps
for every pair, once per process and engine::

    version gate -> engine.prepare (every name checked, nothing changed) -> daemon probe
        -> failure board -> engine.apply -> one WARNING line: the plugin is active

and returns the :class:`Plugin`, the state every patch is built with (the daemon's tables, the model
adapter, the originals patched over, whether the patches were seen applied). The patches get it passed
in; nothing in the plugins reads it back from a module. :func:`installed` gives it to callers outside
the plugins (tests, an engine's own model code asking whether the plugin runs).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from ..errors import EngineUnsupported, EngramStoreError
from ..models.spec import ModelSpec
from . import failures
from .models import ModelAdapter
from .tables import EngramStoreTables, describe_placement

log = logging.getLogger(__name__)


class EngineAdapter(Protocol):
    """One engine's side of a plugin. :meth:`prepare` must change nothing in the engine: a refused
    engine runs stock (the plugins then stop it, as ``ENGRAM_STORE_ADDR`` asked for the daemon)."""

    name: str  # "vLLM", "SGLang": in messages, and the key of :func:`installed`
    supported_versions: tuple[str, ...]  # version prefixes the patches were written against ("0.33.", "0.5.23")

    def version(self) -> str:
        """The engine's version (raises ``EngineUnsupported`` when it cannot be read)."""

    def prepare(self, plugin: "Plugin") -> Any:
        """Look up and check every name the patches replace or read, and build the patches over
        ``plugin``; raise ``EngineUnsupported`` naming the first thing missing. Returns what
        :meth:`apply` takes."""

    def apply(self, plugin: "Plugin", prepared: Any) -> dict[str, Any]:
        """Put the patches in place; returns the originals they replace, by name."""

    def check_applied(self, plugin: "Plugin") -> None:
        """Raise ``EngineUnsupported`` unless every patch is in place (called at model build)."""


class Plugin:
    """An installed plugin: the engine and model adapters, the daemon's address and this process's view
    of its tables. Passed to every patch the engine adapter builds."""

    def __init__(self, engine: EngineAdapter, model: ModelAdapter, address: str, version: str) -> None:
        self.engine = engine
        self.model = model
        self.address = address
        self.version = version
        self.originals: dict[str, Any] = {}  # what the patches replaced, by name (set by install)
        self._applied = False

    def tables(self) -> EngramStoreTables:
        """The daemon's tables in this process (the arena mapped on first use, once); their fetch jobs
        write their failures on the server's failure board, for every rank to see."""
        t = EngramStoreTables.shared(self.address)
        if t.failure_board is None:
            t.failure_board = failures.board()
        return t

    def check_applied(self) -> None:
        """Raise unless every patch is in place (checked once: the patches that run at model build call
        it, as an engine may skip a patch it could not apply and load the tables from the checkpoint)."""
        if not self._applied:
            self.engine.check_applied(self)
            self._applied = True


_lock = threading.Lock()
_installed: dict[str, Plugin] = {}  # engine name -> its plugin in this process


def install(engine: EngineAdapter, model: ModelAdapter, address: str) -> Plugin:
    """Check ``engine`` and patch it to read ``model``'s tables from the daemon at ``address`` (once per
    process: a second call for the same address returns the same plugin, for another one raises)."""
    with _lock:
        plugin = _installed.get(engine.name)
        if plugin is not None:
            if plugin.address != address:
                raise EngineUnsupported(f"engram-store plugin already active for {plugin.address}, "
                                        f"asked again for {address}")
            return plugin
        version = engine.version()
        if not version.startswith(engine.supported_versions):
            supported = ", ".join(v + "x" if v.endswith(".") else v for v in engine.supported_versions)
            raise EngineUnsupported(f"engram-store's {engine.name} plugin supports {engine.name} {supported}, this is "
                                    f"{engine.name} {version}; unset ENGRAM_STORE_ADDR to run {engine.name} without "
                                    "engram-store, or install a matching engram-store")
        plugin = Plugin(engine, model, address, version)
        prepared = engine.prepare(plugin)
        info = EngramStoreTables.probe(address)  # a daemon must answer now, not at model build
        failures.board()  # made here (the server's first process) or inherited: shared by every rank it starts
        plugin.originals = engine.apply(plugin, prepared)
        _installed[engine.name] = plugin
    log.warning("engram-store plugin ACTIVE: %s %s reads %s tables from the engram-store daemon at %s (%s; the "
                "checkpoint's table tensors are not read)", engine.name, version, served_family(info, model), address,
                describe_placement(info))
    return plugin


def served_family(info: dict, model: ModelAdapter) -> str:
    """The model family of the tables the daemon serves (its Info's spec), else the adapter's."""
    try:
        return ModelSpec.from_dict(info["spec"]).family
    except (KeyError, TypeError, EngramStoreError):
        return model.name


def installed(engine: str) -> Plugin | None:
    """The plugin installed for ``engine`` (an :attr:`EngineAdapter.name`) in this process, or None."""
    return _installed.get(engine)


def installed_tables(engine: str) -> EngramStoreTables:
    """The tables of the plugin installed for ``engine``; raises ``EngineUnsupported`` when none is."""
    plugin = _installed.get(engine)
    if plugin is None:
        raise EngineUnsupported(f"the engram-store {engine} plugin is not installed in this process")
    return plugin.tables()


def reads_whole_files(what: str) -> EngineUnsupported:
    """The refusal of a loading path that reads whole checkpoint files."""
    return EngineUnsupported(f"{what} reads whole checkpoint files, Engram tables included (189 GiB), which "
                             "engram-store serves instead; use the default safetensors loader")


def writes_tables(what: str) -> EngineUnsupported:
    """The refusal of a path that writes into the model's parameters while they are the daemon's arena."""
    return EngineUnsupported(f"{what} would write into the Engram tables, which are the engram-store daemon's "
                             "read-only arena; it is not available while the engram-store plugin is active "
                             "(unset ENGRAM_STORE_ADDR to use it)")
