"""The configuration reference (``docs/configuration.md``), generated from the code's own declarations.

Every key of :class:`~engram_store.daemon.config.DaemonConfig` with its type, default,
``ENGRAM_STORE_<KEY>`` variable, ``serve`` flag and meaning: the one-line comment on its field
in ``config.py``, then the prose above the key in the shipped ``deploy/engram-store.toml``
(grouped by that file's sections). The clients' own variables come from the comments of
:data:`~engram_store.daemon.config.CLIENT_ENV`. A key without either text is an error, so the
reference cannot fall behind the code::

    python -m engram_store.daemon.config_reference --out docs/configuration.md   # write it
    python -m engram_store.daemon.config_reference --check docs/configuration.md # exit 1 if stale
"""

from __future__ import annotations

import argparse
import ast
import importlib.resources
import io
import json
import sys
import tokenize
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from ..errors import ConfigError
from . import config as config_module
from .config import CLIENT_ENV, ENV_PREFIX, SIZE_KEYS, DaemonConfig

COMMAND = "python -m engram_store.daemon.config_reference --out docs/configuration.md"
_TYPES = {"int": "integer", "bool": "boolean", "str": "string", "float": "number"}
_SPECIAL_TYPES = {"socket_mode": "octal mode", "placement": "placement"}
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclass(frozen=True)
class Key:
    """One config key as the reference shows it."""

    name: str
    type: str
    default: str  # as written in a TOML file
    summary: str  # the field's comment in config.py
    prose: str  # the key's documentation in deploy/engram-store.toml
    section: str
    example: str = ""  # the value deploy/engram-store.toml sets, when it is not the default

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        flag = "--" + self.name.replace("_", "-")
        return f"{flag} / --no-{flag[2:]}" if self.type == "boolean" else flag


# --- reading the declarations ---------------------------------------------------------------
def _comments(source: str) -> dict[int, str]:
    """line number -> the text of the comment on it."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _comment_at(lines: list[str], comments: dict[int, str], line: int) -> str:
    """The comment on ``line`` and the comment-only lines right below it, joined."""
    parts = [comments[line]] if line in comments else []
    nxt = line + 1
    while nxt <= len(lines) and lines[nxt - 1].lstrip().startswith("#"):
        parts.append(comments[nxt])
        nxt += 1
    return " ".join(parts)


def _module_source() -> str:
    return Path(config_module.__file__).read_text()


def field_comments() -> dict[str, str]:
    """Each DaemonConfig field's comment in config.py."""
    source = _module_source()
    lines, comments = source.splitlines(), _comments(source)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == DaemonConfig.__name__)
    return {node.target.id: _comment_at(lines, comments, node.end_lineno) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def client_env_comments() -> dict[str, str]:
    """Each CLIENT_ENV name's comment in config.py."""
    source = _module_source()
    lines, comments = source.splitlines(), _comments(source)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CLIENT_ENV" for t in node.targets):
            names = [n for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            out = {n.value: _comment_at(lines, comments, n.end_lineno) for n in names}
            undocumented = sorted(set(CLIENT_ENV) - {name for name, text in out.items() if text})
            if undocumented:
                raise ConfigError(f"CLIENT_ENV names without a comment in config.py: {', '.join(undocumented)}")
            return out
    raise ConfigError("config.py declares no CLIENT_ENV")


def default_toml() -> Path:
    """deploy/engram-store.toml: inside the installed package (engram_store.deploy), else the source tree's."""
    try:
        path = Path(str(importlib.resources.files("engram_store.deploy") / "engram-store.toml"))
        if path.is_file():
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "deploy" / "engram-store.toml"


def toml_prose(path: Path) -> dict[str, tuple[str, str]]:
    """key -> (section, the comment block right above it) in a documented TOML file. A key written
    right under another key (grpc_tls_key under grpc_tls_cert) shares that key's text."""
    out: dict[str, tuple[str, str]] = {}
    section, block, last = "", [], None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("# ---"):
            section, block, last = line.strip("#- ").strip(), [], None
        elif line.startswith("#"):
            block.append(line[1:].strip())
            last = None
        elif not line:
            block, last = [], None
        elif "=" in line:
            key = line.split("=", 1)[0].strip()
            text = " ".join(block) if block else (out[last][1] if last else "")
            out[key] = (section, text)
            block, last = [], key
    return out


# --- formatting --------------------------------------------------------------------------
def format_default(name: str, value) -> str:
    """A default as it is written in a TOML file."""
    if name in SIZE_KEYS:
        for unit, size in _UNITS:
            if value and value % size == 0:
                return f'"{value // size}{unit}"'
        return str(value)
    if name == "socket_mode":
        return f'"{value:04o}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def keys(toml: Path | None = None) -> list[Key]:
    """Every config key, in the TOML file's order; ConfigError when one is not documented."""
    toml = toml or default_toml()
    summaries, prose, values = field_comments(), toml_prose(toml), config_module.read_toml(toml)
    missing = [f.name for f in fields(DaemonConfig) if not summaries.get(f.name)]
    missing += [f"{f.name} (in {toml.name})" for f in fields(DaemonConfig) if not prose.get(f.name, ("", ""))[1]]
    if missing:
        raise ConfigError(f"config keys without documentation: {', '.join(missing)}; every DaemonConfig field needs "
                          f"a comment in config.py and a comment block above it in {toml}")
    order = {name: i for i, name in enumerate(prose)}
    out = []
    for f in sorted(fields(DaemonConfig), key=lambda f: order.get(f.name, len(order))):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kind = "size" if f.name in SIZE_KEYS else _SPECIAL_TYPES.get(f.name, _TYPES[str(f.type)])
        section, text = prose[f.name]
        example = format_default(f.name, values[f.name]) if values.get(f.name, default) != default else ""
        out.append(Key(f.name, kind, format_default(f.name, default), summaries[f.name], text, section, example))
    return out


def _sentence(text: str) -> str:
    """``text`` with a capital first letter when its first word is a plain lowercase word (not gRPC, not "auto")."""
    first = text.split(" ", 1)[0]
    return text[:1].upper() + text[1:] if first.isalpha() and first.islower() else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(toml: Path | None = None) -> str:
    """The whole of docs/configuration.md."""
    all_keys = keys(toml)
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from engram_store/daemon/config.py and deploy/engram-store.toml; "
        "do not edit by hand (tests/test_config_reference.py fails when it differs). -->",
        "",
        "`engram-store serve` takes every key below from, highest first: its command-line flag, the environment "
        f"variable `{ENV_PREFIX}<KEY>`, the TOML file (`--config FILE` or `{ENV_PREFIX}CONFIG`), the default. "
        "Unknown keys and bad values stop the daemon at start (exit 2) with a message naming the key and why. "
        'Sizes take whole bytes or units (`"512MiB"`, `"8GiB"`, `"1.5TB"`); a TOML float is refused. '
        "`deploy/engram-store.toml` lists every key with this documentation (`python -m engram_store.deploy` "
        "prints where an installed package keeps it); `engram-store doctor --config FILE` checks a config "
        "against the host.",
        "",
        "| key | type | default | environment variable | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    out += [f"| [`{k.name}`](#{k.name}) | {k.type} | `{_cell(k.default)}` | `{k.env}` | {_cell(k.summary)} |"
            for k in all_keys]
    section = None
    for k in all_keys:
        if k.section != section:
            section = k.section
            out += ["", f"## {_sentence(section)}"]
        example = f" (`deploy/engram-store.toml` sets `{k.example}`)" if k.example else ""
        out += ["", f"### {k.name}", "",
                f"{k.type}, default `{k.default}`{example}; environment `{k.env}`; flag `{k.flag}`.", "",
                _sentence(k.summary) + ("" if k.summary.endswith(".") else "."), "", k.prose]
    out += ["", "## Clients' environment variables", "",
            "Read by the clients and the engine plugins, not by the daemon (a daemon started in the same "
            "environment ignores them); `ENGRAM_STORE_GRPC_TOKEN_FILE` is read by gRPC clients too (the key "
            "`grpc_token_file`).", "",
            "| variable | read by, and meaning |", "| --- | --- |"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in sorted(client_env_comments().items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engram_store.daemon.config_reference",
                                 description="Print the configuration reference (Markdown) generated from "
                                 "DaemonConfig and deploy/engram-store.toml.")
    ap.add_argument("--toml", type=Path, default=None, help="the documented TOML file (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=None, help="write it here instead of stdout")
    ap.add_argument("--check", type=Path, default=None, metavar="FILE",
                    help="exit 1 when FILE differs from what would be generated")
    args = ap.parse_args(argv)
    try:
        text = render(args.toml)
    except ConfigError as exc:
        print(f"config_reference: error: {exc}", file=sys.stderr)
        return 2
    if args.check is not None:
        if not args.check.is_file() or args.check.read_text() != text:
            print(f"{args.check} is not what the code declares: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if args.out is not None:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
