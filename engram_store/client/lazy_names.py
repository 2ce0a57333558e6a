"""Package names imported on first use: ``engram_store.client`` and ``gpu_client`` import nothing heavy
(no gRPC, no torch) until one of their public names is asked for."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose names ``exports`` maps to the modules
    (absolute, or relative to ``package``) they come from; each is imported once, on first use."""
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source, package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
