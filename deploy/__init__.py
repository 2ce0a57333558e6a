"""The deploy files, shipped inside the package as ``engram_store.deploy``.

``python -m engram_store.deploy`` prints the directory; beside this file:
``engram-store.toml`` (engine-ready example: every layer resident),
``engram-store-cached.toml`` (layer 14 cached on NVMe), ``systemd/`` (the unit,
``sysusers.d/`` and ``tmpfiles.d/``), ``container/`` (Dockerfiles) and ``k8s/``
(a kustomize base). In a source tree this is ``deploy/``.
"""

from pathlib import Path

DIR = Path(__file__).resolve().parent


def path(*parts: str) -> Path:
    """A deploy file, e.g. ``path("systemd", "engram-store.service")``."""
    return DIR.joinpath(*parts)
