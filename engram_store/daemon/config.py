"""The daemon's configuration: one frozen dataclass, validated on construction.

Precedence, highest first: command-line flags, ``ENGRAM_STORE_<KEY>``
environment variables, the TOML file (``--config`` or ``ENGRAM_STORE_CONFIG``),
then the defaults below. Every key is documented in ``deploy/engram-store.toml``
(a test keeps the two in step). Unknown keys and bad values raise
:class:`~engram_store.errors.ConfigError` naming the key and saying why.

Two stages, both before any table byte is read: :class:`DaemonConfig` checks
each value on its own (types, ranges, combinations); :func:`preflight` checks
them against the host (the table set's manifest, the socket directory and
group, TLS and token files, the warm-up profile, free ports).
"""

from __future__ import annotations

import dataclasses
import decimal
import grp
import ipaddress
import logging
import os
import re
import socket
import ssl
import stat
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..errors import ConfigError, EngramStoreError
from ..storage.placement import format_placement, parse_placement
from ..storage.policies import POLICIES

log = logging.getLogger(__name__)

ENV_PREFIX = "ENGRAM_STORE_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
          "T": 1000**4, "TB": 1000**4, "KI": 1 << 10, "KIB": 1 << 10, "MI": 1 << 20, "MIB": 1 << 20,
          "GI": 1 << 30, "GIB": 1 << 30, "TI": 1 << 40, "TIB": 1 << 40}
SIZE_KEYS = frozenset({"dram_bytes", "client_shm_bytes", "max_client_shm_bytes", "grpc_chunk_bytes",
                       "max_total_client_shm_bytes", "grpc_max_inflight_bytes", "scrub_bytes_per_second"})
MIN_DRAM_BYTES = 64 << 10  # below this a "size" is surely a slip (TOML 8.5 once meant 8 bytes)
MAX_REQUEST_ROWS = 1 << 26  # 512 MiB of int64 ids: gRPC's message limit is a signed 32-bit int
MAX_GRPC_CHUNK_BYTES = 128 << 20  # the client accepts messages up to 256 MiB
MAX_NVME_QUEUE_DEPTH = 256  # TieredStore's MAX_QUEUE_DEPTH (a test keeps the two equal)
MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII without spaces: it travels in a header


def parse_size(text: str | int, key: str = "size") -> int:
    """``"8GiB"`` -> 8589934592; plain integers are bytes."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigError(f"{key}: expected a size such as \"8GiB\" or a whole number of bytes, got {text!r}"
                          + (" (a TOML float is not a size: quote it with a unit, e.g. \"8.5GiB\")"
                             if isinstance(text, float) else ""))
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(text)
        if not m:
            raise ConfigError(f"{key}: expected a size such as 8GiB, 512MiB or 1048576, got {text!r}")
        exact = decimal.Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
        if exact != exact.to_integral_value():
            raise ConfigError(f"{key}: size {text!r} is not a whole number of bytes")
        value = int(exact)
    if value < 0:
        raise ConfigError(f"{key}: size must not be negative, got {text!r}")
    return value


def parse_hostport(text: str, key: str) -> tuple[str, int]:
    """``"127.0.0.1:0"`` -> ("127.0.0.1", 0); ``"[::1]:50051"`` for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{key}: expected HOST:PORT (port 0 picks a free one), got {text!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DaemonConfig:
    """Every setting of ``engram-store serve``; see deploy/engram-store.toml for the prose."""

    tables: str = ""  # table-set directory (required to serve)
    dram_bytes: int = 8 << 30  # DRAM tier budget; tables that fit are served resident
    verify: bool = True  # refuse to start when a layer's data or checksum file is missing or truncated
    store_mode: str = "auto"  # "auto" (layers resident, earliest first, while they fit dram_bytes), "resident" or "cached"
    placement: str = ""  # per-layer "1=resident,14=cached" (TOML: a table {1 = "resident"}); the rest by store_mode
    cache_policy: str = "s3fifo"  # cached mode: DRAM cache policy ("s3fifo" or "lru")
    nvme_queue_depth: int = 64  # NVMe page reads in flight
    huge_pages: bool = True  # back the DRAM tier with huge pages where the host allows
    warmup_profile: str = ""  # access profile loaded into the cache at start ("" = none)
    save_profile: str = ""  # cached mode: the hottest rows written here at stop, atomically ("" = never)
    scrub_bytes_per_second: int = 32 << 20  # cached mode: background page check rate; 0 = no scrub
    socket: str = "/run/engram-store/engram-store.sock"  # Unix socket path; "" disables it
    socket_mode: int = 0o660  # permission bits of the socket file
    socket_group: str = ""  # group owning the socket ("" keeps the daemon's group)
    client_shm_bytes: int = 64 << 20  # shared region per client unless it asks for another size
    max_client_shm_bytes: int = 1 << 30  # largest shared region a client may ask for
    max_total_client_shm_bytes: int = 16 << 30  # all clients' shared regions together; more is refused
    max_clients: int = 1024  # Unix-socket clients at once; more are refused
    max_clients_per_uid: int = 256  # Unix-socket clients of one uid at once (SO_PEERCRED); more are refused
    handshake_timeout_seconds: float = 5.0  # a Unix client's HELLO, a gRPC call's request: not complete by then, dropped
    client_idle_timeout_seconds: float = 600.0  # a Unix client silent this long is dropped; 0 = never
    client_send_timeout_seconds: float = 10.0  # a client (both transports) that reads no reply for this long is dropped
    max_request_rows: int = 1 << 20  # rows per request (both transports); more is RESOURCE_EXHAUSTED
    workers: int = 0  # lookup threads; 0 = one per CPU
    busy_poll_us: int = 200  # Unix clients: poll for the next request this long before sleeping; 0 = never
    unix_native: bool = True  # resident mode: serve Unix lookups in native code (false: the Python path)
    grpc: str = ""  # gRPC listen address, e.g. "127.0.0.1:50051"; "" (default) disables it
    grpc_token_file: str = ""  # file holding the shared token gRPC clients must send (client auth)
    grpc_tls_client_ca: str = ""  # PEM CA bundle: require client certificates it signed (mTLS)
    grpc_allow_remote: bool = False  # must be true to listen on a non-loopback address (TLS required)
    grpc_tls_cert: str = ""  # PEM certificate chain; with grpc_tls_key enables TLS
    grpc_tls_key: str = ""  # PEM private key
    grpc_chunk_bytes: int = 1 << 20  # row bytes per gRPC message; larger lookups stream
    grpc_max_inflight_bytes: int = 1 << 30  # reply bytes all gRPC lookups may hold at once; more is refused
    grpc_max_calls_per_peer: int = 256  # authenticated gRPC calls in flight from one host; more are refused
    grpc_event_loop: str = "uvloop"  # "uvloop" or "asyncio"
    metrics: str = "127.0.0.1:9464"  # Prometheus HTTP address; "" disables it
    metrics_allow_remote: bool = False  # must be true to serve metrics on a non-loopback address
    ready_file: str = ""  # JSON written once every listener is open
    drain_seconds: float = 30.0  # SIGTERM: longest wait for in-flight requests
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"config key {key!r}: {why} (got {getattr(self, key)!r})")

        for f in fields(self):
            value = getattr(self, f.name)
            want = {"int": int, "bool": bool, "str": str, "float": (int, float)}[str(f.type)]
            if not isinstance(value, want) or (str(f.type) != "bool" and isinstance(value, bool)):
                raise bad(f.name, f"expected {f.type}")
        for key in ("dram_bytes", "client_shm_bytes", "max_client_shm_bytes", "grpc_chunk_bytes",
                    "max_clients", "max_request_rows", "max_clients_per_uid", "max_total_client_shm_bytes",
                    "grpc_max_inflight_bytes", "grpc_max_calls_per_peer"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        if self.dram_bytes < MIN_DRAM_BYTES:
            raise bad("dram_bytes", f"must be at least {MIN_DRAM_BYTES} bytes (64KiB); give a size with a unit, "
                      "e.g. \"8GiB\"")
        if self.max_request_rows > MAX_REQUEST_ROWS:
            raise bad("max_request_rows", f"must be at most {MAX_REQUEST_ROWS} (2^26 rows per request)")
        if not 4096 <= self.grpc_chunk_bytes <= MAX_GRPC_CHUNK_BYTES:
            raise bad("grpc_chunk_bytes", f"must be in 4KiB..{MAX_GRPC_CHUNK_BYTES >> 20}MiB")
        if self.client_shm_bytes > self.max_client_shm_bytes:
            raise bad("client_shm_bytes", f"must not exceed max_client_shm_bytes ({self.max_client_shm_bytes})")
        if self.client_shm_bytes < 1 << 20:
            raise bad("client_shm_bytes", "must be at least 1MiB")
        if not 0 <= self.socket_mode <= 0o777:
            raise bad("socket_mode", "must be permission bits such as 0660")
        if self.workers < 0:
            raise bad("workers", "must be 0 (one per CPU) or positive")
        if not 0 <= self.busy_poll_us <= 100_000:
            raise bad("busy_poll_us", "must be in 0..100000 (microseconds)")
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH_BYTES:
            raise bad("socket", f"is longer than a Unix socket path may be ({MAX_SOCKET_PATH_BYTES} bytes)")
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            raise bad("grpc_tls_cert", "grpc_tls_cert and grpc_tls_key must be set together")
        if self.grpc_tls_client_ca and not self.grpc_tls_cert:
            raise bad("grpc_tls_client_ca", "client certificates need TLS: set grpc_tls_cert and grpc_tls_key too")
        if self.grpc:
            host, _ = parse_hostport(self.grpc, "grpc")
            if not is_loopback(host) and not self.grpc_allow_remote:
                raise bad("grpc", "is not a loopback address; set grpc_allow_remote = true to listen on it")
            if not is_loopback(host) and not self.grpc_tls_cert:
                raise bad("grpc", "is not a loopback address and plaintext remote gRPC is refused; "
                          "set grpc_tls_cert and grpc_tls_key")
            if not self.grpc_token_file and not self.grpc_tls_client_ca:
                raise bad("grpc", "gRPC needs client authentication: set grpc_token_file (a shared token) or "
                          "grpc_tls_client_ca (client certificates), or grpc = \"\" to serve only the Unix socket")
        if self.metrics:
            host, _ = parse_hostport(self.metrics, "metrics")
            if not is_loopback(host) and not self.metrics_allow_remote:
                raise bad("metrics", "is not a loopback address; set metrics_allow_remote = true to serve on it")
        if self.store_mode not in ("auto", "resident", "cached"):
            raise bad("store_mode", "must be 'auto', 'resident' or 'cached'")
        try:
            parse_placement(self.placement)
        except ConfigError as exc:
            raise bad("placement", str(exc)) from None
        if self.cache_policy not in POLICIES:
            raise bad("cache_policy", f"must be one of {', '.join(map(repr, POLICIES))}")
        if not 1 <= self.nvme_queue_depth <= MAX_NVME_QUEUE_DEPTH:
            raise bad("nvme_queue_depth", f"must be in 1..{MAX_NVME_QUEUE_DEPTH}")
        if self.grpc_event_loop not in ("uvloop", "asyncio"):
            raise bad("grpc_event_loop", "must be 'uvloop' or 'asyncio'")
        if not 0 < self.client_send_timeout_seconds <= 3600:
            raise bad("client_send_timeout_seconds", "must be in (0, 3600] seconds")
        if not 0 < self.handshake_timeout_seconds <= 600:
            raise bad("handshake_timeout_seconds", "must be in (0, 600] seconds")
        if not 0 <= self.client_idle_timeout_seconds <= 7 * 86400:
            raise bad("client_idle_timeout_seconds", "must be in [0, 604800] seconds (0 = never)")
        if self.max_total_client_shm_bytes < self.client_shm_bytes:
            raise bad("max_total_client_shm_bytes", f"must hold at least one region of client_shm_bytes "
                                                    f"({self.client_shm_bytes})")
        if self.grpc_max_inflight_bytes < self.grpc_chunk_bytes:
            raise bad("grpc_max_inflight_bytes", f"must hold at least one message of grpc_chunk_bytes "
                                                 f"({self.grpc_chunk_bytes})")
        if self.drain_seconds < 0:
            raise bad("drain_seconds", "must not be negative")
        if self.scrub_bytes_per_second < 0:
            raise bad("scrub_bytes_per_second", "must be 0 (no scrub) or a rate such as \"32MiB\"")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise bad("log_level", "must be DEBUG, INFO, WARNING or ERROR")

    @property
    def worker_count(self) -> int:
        return self.workers or os.cpu_count() or 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


KEYS: dict[str, str] = {f.name: str(f.type) for f in fields(DaemonConfig)}


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn a TOML/env/CLI value into the field's type, or say why not."""
    kind = KEYS[key]
    try:
        if key in SIZE_KEYS:
            return parse_size(value, key)
        if key == "socket_mode":
            return int(value, 8) if isinstance(value, str) else int(value)
        if key == "placement":  # a TOML table or "1=resident,14=cached": kept as the canonical string
            return format_placement(parse_placement(value if isinstance(value, dict) else str(value)))
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if kind == "int":
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError("expected an integer")
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: config key {key!r}: {exc} (got {value!r})") from None


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                          f"known keys: {', '.join(sorted(KEYS))}")


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    _check_keys(raw, f"config file {path}")
    return {k: _coerce(k, v, f"config file {path}") for k, v in raw.items()}


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``ENGRAM_STORE_<KEY>`` variables (``ENGRAM_STORE_CONFIG`` names the file, not a key)."""
    values = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
              if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG"}
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        names = ", ".join(ENV_PREFIX + k.upper() for k in unknown)
        raise ConfigError(f"unknown environment variable(s) {names}; known: "
                          f"{', '.join(ENV_PREFIX + k.upper() for k in sorted(KEYS))}")
    return {k: _coerce(k, v, f"environment {ENV_PREFIX}{k.upper()}") for k, v in values.items()}


def load_config(cli: Mapping[str, Any] | None = None, *, config_file: str | os.PathLike | None = None,
                environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Merge defaults < file < environment < ``cli`` (keys whose value is None are unset)."""
    environ = os.environ if environ is None else environ
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    _check_keys(cli, "command line")
    path = config_file or environ.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = read_toml(path) if path else {}
    merged.update(read_env(environ))
    merged.update({k: _coerce(k, v, f"--{k.replace('_', '-')}") for k, v in cli.items()})
    try:
        return DaemonConfig(**merged)
    except TypeError as exc:  # defensive: a key slipped past _check_keys
        raise ConfigError(str(exc)) from None



# --- preflight: the values against the host, before any table byte is read -------------
def read_token(path: str, key: str = "grpc_token_file") -> str:
    """The shared gRPC token in ``path`` (surrounding whitespace stripped), or ConfigError.

    The file must not be readable or writable by every user: give it mode 0640 and the
    socket's group, so that exactly the users who may use the socket may use gRPC."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(4097)
    except OSError as exc:
        raise ConfigError(f"config key {key!r}: cannot read {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(f"config key {key!r}: {path} has mode {stat.S_IMODE(mode):04o}, open to every user; "
                          "chmod 0640 and give it the socket's group")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        token = ""
    if len(raw) > 4096 or len(token) < MIN_TOKEN_CHARS or not _TOKEN.match(token):
        raise ConfigError(f"config key {key!r}: {path} must hold one token of {MIN_TOKEN_CHARS} to 4096 printable "
                          "ASCII characters without spaces (make one with `openssl rand -hex 32`)")
    return token


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
    host, port = parse_hostport(address, key)
    if port == 0:
        return
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except OSError as exc:
        raise ConfigError(f"config key {key!r}: cannot listen on {address}: {exc.strerror or exc}") from None


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
    if config.socket_group:
        try:
            gid = grp.getgrnam(config.socket_group).gr_gid
        except KeyError:
            raise ConfigError(f"config key 'socket_group': {config.socket_group!r} is not a group on this host") from None
        if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
            raise ConfigError(f"config key 'socket_group': the daemon (uid {os.geteuid()}) is not a member of "
                              f"{config.socket_group!r}, so it cannot give the socket to it")


def _check_tables(config: DaemonConfig) -> None:
    """The manifest (not the data) against the DRAM settings and the warm-up profile."""
    from ..format.manifest import Manifest
    from ..storage.placement import plan_store, slot_bytes
    from ..storage.profile import read_profile
    from ..storage.resident import resident_layout
    from ..tokens import read_token_map

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
    dense = resident_layout([(e.layer, e.rows) for e in manifest.layers], manifest.spec.row_format).size
    if config.store_mode == "resident" and config.dram_bytes < dense:
        raise ConfigError(f"config key 'dram_bytes': store_mode 'resident' needs at least {dense} bytes (the dense "
                          f"table set), got {config.dram_bytes}; raise it or use store_mode 'auto' or 'cached'")
    per_slot = slot_bytes(manifest.spec.row_bytes, config.cache_policy)
    if config.dram_bytes < dense and config.dram_bytes < per_slot:
        raise ConfigError(f"config key 'dram_bytes': {config.dram_bytes} bytes hold no cache slot ({per_slot} bytes "
                          "each)")
    try:
        plan_store(manifest, dram_bytes=config.dram_bytes, mode=config.store_mode, policy=config.cache_policy,
                   placement=parse_placement(config.placement))
    except ConfigError as exc:
        raise ConfigError(f"config key 'placement' / 'dram_bytes': {exc}") from None
    if config.warmup_profile and not warmup_pending(config):
        try:
            pairs = read_profile(config.warmup_profile)
        except EngramStoreError as exc:
            raise ConfigError(f"config key 'warmup_profile': {exc}") from None
        unknown = sorted(set(pairs[:, 0].tolist()) - {e.layer for e in manifest.layers})
        if unknown:
            raise ConfigError(f"config key 'warmup_profile': {config.warmup_profile} names layers {unknown[:8]} "
                              f"that the table set does not hold ({[e.layer for e in manifest.layers]})")


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


def preflight(config: DaemonConfig) -> None:
    """Check ``config`` against the host without reading table data; ConfigError naming the key.

    Reads the manifest, TLS, token and profile files; creates the socket directory; binds the
    gRPC and metrics ports for a moment. Meant to run at start, before the tables are opened."""
    _check_tables(config)
    if config.save_profile:
        _check_save_profile(config.save_profile)
    if config.socket:
        _check_socket(config)
    if config.grpc:
        _check_tls(config)
        if config.grpc_token_file:
            read_token(config.grpc_token_file)
        _check_port("grpc", config.grpc)
    if config.metrics:
        if config.grpc and config.metrics == config.grpc and not config.grpc.endswith(":0"):
            raise ConfigError(f"config key 'metrics': {config.metrics} is also the gRPC address")
        _check_port("metrics", config.metrics)
