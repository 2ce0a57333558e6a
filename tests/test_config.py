"""DaemonConfig: precedence CLI > env > file > defaults; unknown keys and bad values named."""

from __future__ import annotations

import dataclasses

import pytest

from engram_store.daemon.config import KEYS, DaemonConfig, load_config, parse_size
from engram_store.errors import ConfigError


def _write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_are_safe():
    cfg = load_config(environ={})
    assert cfg == DaemonConfig()
    assert cfg.grpc == "" and cfg.socket_mode == 0o660 and cfg.grpc_event_loop == "uvloop"  # gRPC is opt-in
    assert cfg.metrics.startswith("127.0.0.1:") and not cfg.metrics_allow_remote


def test_precedence_cli_over_env_over_file(tmp_path):
    path = _write(tmp_path, 'tables = "/file"\ndram_bytes = "2GiB"\nworkers = 3\nsocket_mode = "0600"\n')
    env = {"ENGRAM_STORE_DRAM_BYTES": "3GiB", "ENGRAM_STORE_WORKERS": "5", "ENGRAM_STORE_VERIFY": "false"}
    cfg = load_config({"workers": "7", "tables": None}, config_file=path, environ=env)
    assert (cfg.tables, cfg.dram_bytes, cfg.workers, cfg.verify, cfg.socket_mode) == ("/file", 3 << 30, 7, False, 0o600)
    env["ENGRAM_STORE_CONFIG"] = str(path)  # the file may come from the environment too
    assert load_config(environ=env).tables == "/file"


@pytest.mark.parametrize("text, value", [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5KiB", 1536), ("1000", 1000),
                                         (4096, 4096), ("2 GB", 2_000_000_000), ("7b", 7)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["8 parsecs", "-1", "GiB", "", True, "1e9", 8.5, 8.0, "8.5", "0.3KiB"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text, "dram_bytes")


def test_unknown_keys_are_named_everywhere(tmp_path):
    with pytest.raises(ConfigError, match="'dram_byte'.*known keys"):
        load_config(config_file=_write(tmp_path, 'dram_byte = "1GiB"\n'), environ={})
    with pytest.raises(ConfigError, match="ENGRAM_STORE_SOKET"):
        load_config(environ={"ENGRAM_STORE_SOKET": "/x"})
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config({"bogus": 1}, environ={})


@pytest.mark.parametrize("key, value, words", [
    ("dram_bytes", "lots", "dram_bytes"),
    ("workers", "-2", "workers"),
    ("workers", "two", "workers"),
    ("busy_poll_us", "-1", "busy_poll_us"),
    ("busy_poll_us", "1000000", "busy_poll_us"),
    ("verify", "maybe", "verify"),
    ("socket_mode", "0999", "socket_mode"),
    ("grpc", "localhost", "HOST:PORT"),
    ("grpc", "10.0.0.1:50051", "grpc_allow_remote"),
    ("grpc", "127.0.0.1:50051", "grpc_token_file.*grpc_tls_client_ca"),  # no client authentication
    ("metrics", "0.0.0.0:9464", "metrics_allow_remote"),
    ("dram_bytes", "8", "dram_bytes.*at least"),
    ("cache_policy", "fifo", "cache_policy.*'s3fifo'"),
    ("nvme_queue_depth", "257", "nvme_queue_depth.*1..256"),
    ("max_request_rows", str(1 << 40), "max_request_rows.*at most"),
    ("grpc_chunk_bytes", "1GiB", "grpc_chunk_bytes"),
    ("grpc_tls_client_ca", "/ca.pem", "grpc_tls_cert"),
    ("socket", "/run/" + "s" * 120, "socket.*longer"),
    ("grpc_event_loop", "trio", "grpc_event_loop"),
    ("store_mode", "mostly", "store_mode"),
    ("log_level", "chatty", "log_level"),
    ("client_shm_bytes", "2GiB", "max_client_shm_bytes"),
    ("grpc_tls_cert", "/c.pem", "together"),
    ("max_request_rows", "0", "positive"),
])
def test_bad_values_are_refused_with_the_key(key, value, words):
    with pytest.raises(ConfigError, match=words):
        load_config({key: value}, environ={})


def test_toml_float_is_not_a_size(tmp_path):
    with pytest.raises(ConfigError, match="dram_bytes.*TOML float"):
        load_config(config_file=_write(tmp_path, "dram_bytes = 8.5\n"), environ={})


def test_toml_types_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="workers"):
        load_config(config_file=_write(tmp_path, "workers = 1.5\n"), environ={})
    with pytest.raises(ConfigError, match="tables"):
        load_config(config_file=_write(tmp_path, "tables = 3\n"), environ={})
    with pytest.raises(ConfigError, match="c.toml"):
        load_config(config_file=_write(tmp_path, "tables = \n"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=tmp_path / "missing.toml", environ={})


def test_remote_grpc_needs_opt_in_tls_and_client_auth():
    remote = {"grpc": "0.0.0.0:50051", "grpc_allow_remote": True, "grpc_token_file": "/t"}
    with pytest.raises(ConfigError, match="plaintext remote"):
        load_config(remote, environ={})
    tls = {"grpc_tls_cert": "/c.pem", "grpc_tls_key": "/k.pem"}
    assert load_config(remote | tls, environ={}).grpc == "0.0.0.0:50051"
    mtls = {"grpc": "0.0.0.0:50051", "grpc_allow_remote": True, "grpc_tls_client_ca": "/ca.pem"} | tls
    assert load_config(mtls, environ={}).grpc_tls_client_ca == "/ca.pem"
    assert load_config({"grpc": "127.0.0.1:0", "grpc_token_file": "/t"}, environ={}).grpc == "127.0.0.1:0"


def test_queue_depth_range_is_the_stores():
    from engram_store.daemon.config import MAX_NVME_QUEUE_DEPTH
    from engram_store.storage.tiered import MAX_QUEUE_DEPTH

    assert MAX_NVME_QUEUE_DEPTH == MAX_QUEUE_DEPTH
    assert load_config({"nvme_queue_depth": "256"}, environ={}).nvme_queue_depth == 256


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DaemonConfig().workers = 3  # type: ignore[misc]


def test_every_key_has_a_type():
    assert set(KEYS.values()) <= {"int", "bool", "str", "float"}
