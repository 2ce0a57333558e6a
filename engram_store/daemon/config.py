"""The daemon's configuration: one frozen dataclass, validated on construction.

Precedence, highest first: command-line flags, ``ENGRAM_STORE_<KEY>``
environment variables, the TOML file (``--config`` or ``ENGRAM_STORE_CONFIG``),
then the defaults below. Every key is documented in ``deploy/engram-store.toml``
(a test keeps the two in step). Unknown keys and bad values raise
:class:`~engram_store.errors.ConfigError` naming the key and saying why.

Two stages, both before any table byte is read: :class:`DaemonConfig` checks
each value on its own (types, ranges, combinations);
:func:`~engram_store.daemon.preflight.preflight` checks them against the host
(the socket, the table set's manifest, memory, the warm-up profile, TLS and
token files, free ports).
"""

from __future__ import annotations

import dataclasses
import decimal
import ipaddress
import logging
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..errors import ConfigError
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
MAX_HINT_CACHE_SHARE = 0.9  # hinted rows never take the whole cache: the rows decode steps hit keep the rest
MAX_HINT_ROWS = 1 << 30  # hint_rows_per_second and hint_max_queued_rows at most (8 GiB of queued ids)
MIN_TOKEN_CHARS = 16
# Variables the clients read, not the daemon: an engine pod sets them for its plugins, and a daemon
# started in the same environment must not take them for unknown keys. (ENGRAM_STORE_GRPC_TOKEN_FILE,
# read by clients too, is the daemon's own key grpc_token_file.) tests/test_preflight.py finds every
# ENGRAM_STORE_* name the client, gpu_client and integrations code reads and checks it is here or a key.
# Each name's comment (with the lines continuing it) is its entry in docs/configuration.md.
CLIENT_ENV = frozenset({
    "ENGRAM_STORE_ADDR",  # engram_store.integrations (vLLM, SGLang): the daemon to use, e.g.
    # unix:///run/engram-store/engram-store.sock; unset, the plugins do nothing
    "ENGRAM_STORE_FETCH_DEADLINE_SECONDS",  # engram_store.fetch.job: seconds a fetch job's step may take,
    # the daemon hedged by direct page reads, before it fails with its rows zero (default 2)
    "ENGRAM_STORE_FETCH_HEDGE_SECONDS",  # engram_store.fetch.job: a fixed hedge budget, seconds a step
    # waits for the daemon before it also reads the pages itself (unset: measured, 2 ms + 2 x p99 of its
    # answers, at most 100 ms; equal to the deadline: never)
    "ENGRAM_STORE_DIRECT_BUDGET_PAGES",  # engram_store.fetch.budget: direct page reads in flight that
    # all fetch jobs on the node reading one device may have together, hedged and fallback reads alike;
    # beyond it a step waits for its daemon (unset: the device's queue depth from sysfs, else 1024; 0: no bound)
    "ENGRAM_STORE_DIRECT_BUDGET_DIR",  # engram_store.fetch.budget: the directory of the budget files,
    # one a device (default /dev/shm; a directory every engine container on the node mounts makes it node-wide)
    "ENGRAM_STORE_CONNECT_WAIT_SECONDS",  # engram_store.integrations: seconds a plugin waits at load for a
    # daemon that is not listening yet (default 30)
    "ENGRAM_STORE_DAEMON_UID",  # engram_store.client.unix_socket: the users a daemon may run as, for clients
    # (names or uids, comma-separated; unset: root, the client's user and the owner of the socket's directory)
    "ENGRAM_STORE_FAILURE_BOARD",  # engram_store.integrations.failures: set by the plugins themselves, the
    # failure board (/proc/PID/fd/N#ID: a sealed 4 KiB memfd) a server's first process makes for the ranks it
    # starts (a process it did not start makes its own)
})
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
    hint_cache_share: float = 0.25  # cached layers: share of the cache hinted rows (read ahead) may hold; 0 = off
    hint_queue_depth: int = 16  # NVMe reads in flight for hinted rows at most; lookups' reads go first
    hint_max_age_seconds: float = 30.0  # hinted rows unread by then are dropped; read but not looked up, freed
    hint_rows_per_second: int = 2_000_000  # hinted rows one client may send a second (a second's worth at once)
    hint_max_queued_rows: int = 8 << 20  # hinted rows waiting to be read, all clients (8 B each, +96 a hint; 1/4 a client)
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
    unix_native: bool = True  # serve Unix lookups of resident layers, and all-hit ones of cached layers, natively
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
    metrics_max_connections: int = 64  # HTTP connections at once; the slowest sender gives way, or 503
    metrics_request_timeout_seconds: float = 5.0  # seconds an HTTP client has to send its request, and to read the answer
    ready_file: str = ""  # JSON written once every listener is open
    drain_seconds: float = 30.0  # SIGTERM: in-flight requests drained, the process gone within this
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
                    "grpc_max_inflight_bytes", "grpc_max_calls_per_peer", "metrics_max_connections"):
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
        if not 0 < self.metrics_request_timeout_seconds <= 600:
            raise bad("metrics_request_timeout_seconds", "must be in (0, 600] seconds")
        if self.metrics_max_connections > 65536:
            raise bad("metrics_max_connections", "must be at most 65536")
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
        if not 0 <= self.hint_cache_share <= MAX_HINT_CACHE_SHARE:
            raise bad("hint_cache_share", f"must be in 0..{MAX_HINT_CACHE_SHARE} (a share of the cache's slots; 0 = off)")
        if not 1 <= self.hint_queue_depth <= self.nvme_queue_depth:
            raise bad("hint_queue_depth", f"must be in 1..nvme_queue_depth ({self.nvme_queue_depth}): a share of it")
        if not 0 < self.hint_max_age_seconds <= 3600:
            raise bad("hint_max_age_seconds", "must be in (0, 3600] seconds")
        if not 0 <= self.hint_rows_per_second <= MAX_HINT_ROWS:
            raise bad("hint_rows_per_second", f"must be in 0..{MAX_HINT_ROWS} (0: hints are refused)")
        if not 0 <= self.hint_max_queued_rows <= MAX_HINT_ROWS:
            raise bad("hint_max_queued_rows", f"must be in 0..{MAX_HINT_ROWS} (8 bytes of memory each)")
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
    """``ENGRAM_STORE_<KEY>`` variables (``ENGRAM_STORE_CONFIG`` names the file, not a key; the
    clients' own variables, :data:`CLIENT_ENV`, are left to them)."""
    values = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
              if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG" and k not in CLIENT_ENV}
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



# --- files the config names -------------------------------------------------------------
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
