"""Preflight: the config checked against the host before any table byte is read.

:func:`preflight` runs first at start, so that a mistake stops the daemon in a moment
rather than after a DRAM fill (at V4.1 scale, minutes and 189 GiB). In order:

1. the socket: a daemon already serving the path is refused (a socket file nobody listens
   on is a killed daemon's and is replaced at listen); its directory and group;
2. the table set: the manifest against its spec, the token map, each layer file's
   readability and size (with ``verify``), the placement against ``dram_bytes``;
3. memory: what the placement will really allocate (resident arena, cache slots, page
   checksums) against ``MemAvailable`` and every memory cgroup limit above the daemon
   (:mod:`.host`);
4. the warm-up profile: type, header and size checked, then read once, only as far as the
   cache can use; the pairs are handed to the store (never read a second time);
5. ``save_profile``'s directory, TLS and token files, free gRPC and metrics ports.

Each failure is one ConfigError naming the config key and what to do.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import ssl
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, EngramStoreError
from ..format.manifest import Manifest
from ..storage.placement import CACHED, RESIDENT, cache_slots, format_placement, parse_placement, plan_store, slot_bytes
from ..storage.profile import open_profile
from ..storage.resident import arena_backings, resident_layout
from ..models.tokens import read_token_map
from . import host
from .config import DaemonConfig, parse_hostport, read_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What preflight read that the start-up uses next."""

    warmup: np.ndarray | None = None  # the warm-up profile's pairs for the cached layers (None: no warm-up)


def preflight(config: DaemonConfig) -> Preflight:
    """Check ``config`` against the host without reading table data; ConfigError naming the key.

    Probes the socket, reads the manifest, token map, TLS, token and profile files, reads
    the host's memory limits, creates the socket directory, binds the gRPC and metrics
    ports for a moment."""
    if config.socket:
        _check_socket(config)
    manifest = _check_tables(config)
    plan = _check_placement(config, manifest)
    _check_memory(config, manifest, plan)
    warmup = _read_warmup(config, manifest, plan)
    if config.save_profile:
        _check_save_profile(config.save_profile)
    if config.grpc:
        _check_tls(config)
        if config.grpc_token_file:
            read_token(config.grpc_token_file)
        _check_port("grpc", config.grpc)
    if config.metrics:
        if config.grpc and config.metrics == config.grpc and not config.grpc.endswith(":0"):
            raise ConfigError(f"config key 'metrics': {config.metrics} is also the gRPC address")
        _check_port("metrics", config.metrics)
    return Preflight(warmup)


def _check_socket(config: DaemonConfig) -> None:
    directory = os.path.dirname(os.path.abspath(config.socket))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"config key 'socket': cannot create the directory {directory}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"config key 'socket': the daemon (uid {os.geteuid()}) cannot create files in {directory}")
    if os.path.isdir(config.socket):
        raise ConfigError(f"config key 'socket': {config.socket} is a directory")
    try:
        pid = host.probe_socket(config.socket)
    except OSError as exc:
        raise ConfigError(f"config key 'socket': {exc.strerror or exc}; remove it or choose another path") from None
    if pid is not None:
        who = f"process {pid}" if pid else "another process"
        raise ConfigError(f"config key 'socket': {config.socket} is served by {who} (it accepts connections): "
                          "another daemon is running there; stop it first or choose another socket path")
    if config.socket_group:
        try:
            gid = grp.getgrnam(config.socket_group).gr_gid
        except KeyError:
            raise ConfigError(f"config key 'socket_group': {config.socket_group!r} is not a group on this host") from None
        if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
            raise ConfigError(f"config key 'socket_group': the daemon (uid {os.geteuid()}) is not a member of "
                              f"{config.socket_group!r}, so it cannot give the socket to it")


def _check_tables(config: DaemonConfig) -> Manifest:
    """The manifest and token map (not the data), and each layer file's readability and size."""
    if not config.tables:
        raise ConfigError("config key 'tables' is empty: give --tables DIR (a table-set directory)")
    try:
        manifest = Manifest.load(config.tables)
        if manifest.token_map is not None:  # 4 bytes per raw id, not table data: every value in range
            read_token_map(config.tables, manifest.token_map, manifest.spec.compressed_vocab)
    except EngramStoreError as exc:
        raise ConfigError(f"config key 'tables': {exc}") from None
    for e in manifest.layers:
        files = list(zip(map(str, e.stripe_paths(config.tables)), (s.file_bytes for s in e.stripes))) if e.stripes \
            else [(os.path.join(config.tables, e.file), e.file_bytes)]
        for path, want in files:  # the layer's data file, or each of its stripe files
            if os.path.exists(path) and not os.access(path, os.R_OK):
                raise ConfigError(f"config key 'tables': layer {e.layer} file {path} is not readable by the daemon "
                                  f"(uid {os.geteuid()}); publish the table set for the daemon's group "
                                  "(`engram-store synth/import --group GROUP`)")
            if not config.verify:  # the store serves the other layers and reports this one unavailable
                continue
            try:  # a verifying daemon refuses a missing or truncated layer file: say so now
                size = os.stat(path).st_size
            except OSError as exc:
                raise ConfigError(f"config key 'tables': layer {e.layer} file {path}: {exc.strerror}") from None
            if size != want:
                raise ConfigError(f"config key 'tables': layer {e.layer} file {path} has {size} bytes, the manifest "
                                  f"says {want} (truncated?); re-import or re-synth the table set")
    return manifest


def _check_placement(config: DaemonConfig, manifest: Manifest) -> dict[int, str]:
    dense = resident_layout([(e.layer, e.rows) for e in manifest.layers], manifest.spec.row_format).size
    if config.store_mode == "resident" and config.dram_bytes < dense:
        raise ConfigError(f"config key 'dram_bytes': store_mode 'resident' needs at least {dense} bytes (the dense "
                          f"table set), got {config.dram_bytes}; raise it or use store_mode 'auto' or 'cached'")
    per_slot = slot_bytes(manifest.spec.row_bytes, config.cache_policy)
    if config.dram_bytes < dense and config.dram_bytes < per_slot:
        raise ConfigError(f"config key 'dram_bytes': {config.dram_bytes} bytes hold no cache slot ({per_slot} bytes "
                          "each)")
    try:
        return plan_store(manifest, dram_bytes=config.dram_bytes, mode=config.store_mode, policy=config.cache_policy,
                          placement=parse_placement(config.placement))
    except ConfigError as exc:
        raise ConfigError(f"config key 'placement' / 'dram_bytes': {exc}") from None


def dram_allocation(config: DaemonConfig, manifest: Manifest, plan: dict[int, str]) -> dict[str, int]:
    """What the store will allocate for ``plan`` (bytes): the resident arena, the part of it on
    reserved huge pages (outside MemAvailable and the memory cgroup), the cache slots, the
    page checksums."""
    rows = {e.layer: e.rows for e in manifest.layers}
    resident = [(layer, rows[layer]) for layer, where in sorted(plan.items()) if where == RESIDENT]
    backing = arena_backings(resident, manifest.spec.row_format, huge=config.huge_pages)[0] if resident else None
    arena = backing.nbytes if backing else 0
    hugetlb = arena if backing and backing.kind == "hugetlb" else 0
    per_slot = slot_bytes(manifest.spec.row_bytes, config.cache_policy)
    slots = cache_slots(plan, rows, config.dram_bytes, arena, per_slot) if CACHED in plan.values() else 0
    return {"arena": arena, "hugetlb": hugetlb, "cache": slots * per_slot,
            "page_crcs": 4 * sum(e.layout.pages for e in manifest.layers)}


def _check_memory(config: DaemonConfig, manifest: Manifest, plan: dict[int, str]) -> None:
    alloc = dram_allocation(config, manifest, plan)
    need = alloc["arena"] - alloc["hugetlb"] + alloc["cache"] + alloc["page_crcs"]
    short = [lim for lim in host.memory_limits() if need > lim.available]
    if not short:
        return
    parts = f"resident arena {alloc['arena']}" + (f" ({alloc['hugetlb']} of it on reserved huge pages, not counted)"
                                                  if alloc["hugetlb"] else "")
    raise ConfigError(
        f"config key 'dram_bytes': {config.dram_bytes} bytes make the placement {format_placement(plan)} allocate "
        f"{need} bytes ({parts}, cache {alloc['cache']}, page checksums {alloc['page_crcs']}), more than this host "
        "allows: " + "; ".join(f"{lim.name} leaves {lim.available} ({lim.detail}, {lim.where})" for lim in short)
        + "; lower dram_bytes (layers that do not fit are cached) or give the daemon more memory")


def _read_warmup(config: DaemonConfig, manifest: Manifest, plan: dict[int, str]) -> np.ndarray | None:
    """The profile's pairs for the cached layers, as many as the cache holds: read once, here
    (every pair's layer checked), and handed to the store."""
    if not config.warmup_profile or warmup_pending(config):
        return None
    resident = {layer for layer, where in plan.items() if where == RESIDENT}
    slots = dram_allocation(config, manifest, plan)["cache"] // slot_bytes(manifest.spec.row_bytes,
                                                                            config.cache_policy)
    try:
        pairs = open_profile(config.warmup_profile).read(slots, skip_layers=resident,
                                                         known_layers=[e.layer for e in manifest.layers])
    except EngramStoreError as exc:
        raise ConfigError(f"config key 'warmup_profile': {exc}") from None
    return pairs if slots else None


def warmup_pending(config: DaemonConfig) -> bool:
    """The warm-up profile is the one this daemon saves at stop and none was saved yet
    (the first start): start with a cold cache instead of refusing the config."""
    return bool(config.save_profile) and os.path.abspath(config.warmup_profile) == os.path.abspath(
        config.save_profile) and not os.path.exists(config.save_profile)


def _check_save_profile(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"config key 'save_profile': directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"config key 'save_profile': directory {parent} is not writable by this user")


def _check_tls(config: DaemonConfig) -> None:
    if config.grpc_tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for key in ("grpc_tls_cert", "grpc_tls_key"):
            if not os.path.isfile(getattr(config, key)):
                raise ConfigError(f"config key {key!r}: {getattr(config, key)} does not exist or is not a file")
        try:
            context.load_cert_chain(config.grpc_tls_cert, config.grpc_tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"config key 'grpc_tls_cert': {config.grpc_tls_cert} and grpc_tls_key "
                              f"{config.grpc_tls_key} are not a PEM certificate chain and its private key ({exc})") from None
    if config.grpc_tls_client_ca:
        try:
            ssl.create_default_context(cafile=config.grpc_tls_client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"config key 'grpc_tls_client_ca': {config.grpc_tls_client_ca} is not a readable PEM "
                              f"CA bundle ({exc})") from None


def _check_port(key: str, address: str) -> None:
    """Bind ``address`` for a moment (as the listener will: SO_REUSEADDR) unless its port is 0."""
    host_name, port = parse_hostport(address, key)
    if port == 0:
        return
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except OSError as exc:
        raise ConfigError(f"config key {key!r}: cannot listen on {address}: {exc.strerror or exc}") from None
