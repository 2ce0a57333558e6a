"""docs/configuration.md is what the code declares: regenerated here and compared byte for byte."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from engram_store.daemon import config_reference as ref
from engram_store.daemon.config import CLIENT_ENV, DaemonConfig
from engram_store.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "configuration.md"
TOML = REPO / "deploy" / "engram-store.toml"


def test_checked_in_reference_is_what_the_generator_produces():
    assert DOC.read_text() == ref.render(TOML), f"docs/configuration.md is stale: run `{ref.COMMAND}`"


def test_every_key_has_type_default_env_and_meaning():
    text = DOC.read_text()
    for f in fields(DaemonConfig):
        row = next((line for line in text.splitlines() if line.startswith(f"| [`{f.name}`]")), None)
        assert row is not None, f.name
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] and cells[2].startswith("`") and cells[3] == f"`ENGRAM_STORE_{f.name.upper()}`" and cells[4]
        assert f"\n### {f.name}\n" in text


def test_defaults_shown_are_the_dataclass_defaults(tmp_path):
    """Each default as shown, written into a TOML file and read as serve reads it, is the field's default."""
    from engram_store.daemon.config import load_config

    path = tmp_path / "defaults.toml"
    path.write_text("".join(f"{key.name} = {key.default}\n" for key in ref.keys(TOML)))
    assert load_config(config_file=path, environ={}) == DaemonConfig()


def test_client_variables_name_the_defaults_the_code_uses():
    from engram_store.fetch.job import DEFAULT_DEADLINE_SECONDS
    from engram_store.integrations.tables import PROBE_WAIT_SECONDS

    comments = ref.client_env_comments()
    assert set(comments) == set(CLIENT_ENV) and all(comments.values())
    stated = {name: float(m.group(1)) for name, text in comments.items()
              if (m := re.search(r"\(default (\d+(?:\.\d+)?)\)", text))}
    assert stated == {"ENGRAM_STORE_FETCH_DEADLINE_SECONDS": DEFAULT_DEADLINE_SECONDS,
                      "ENGRAM_STORE_CONNECT_WAIT_SECONDS": PROBE_WAIT_SECONDS}


def test_an_undocumented_key_is_an_error(tmp_path):
    lines = TOML.read_text().splitlines()
    i = lines.index("nvme_queue_depth = 64")
    del lines[i - 1]  # its comment
    lines.insert(i - 1, "")  # not even the previous block's
    bad = tmp_path / "engram-store.toml"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="nvme_queue_depth"):
        ref.render(bad)


def test_check_mode_exit_status(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text() + "drift\n")
    cmd = [sys.executable, "-m", "engram_store.daemon.config_reference"]
    res = subprocess.run(cmd + ["--check", str(stale)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and ref.COMMAND in res.stderr
    assert subprocess.run(cmd + ["--check", str(DOC)], timeout=60).returncode == 0
