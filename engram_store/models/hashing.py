"""Engram row ids from compressed token ids, bit-exact with the model.

Two implementations of the recipe in ``shared/ENGRAM.md``:

* :func:`row_ids_numpy` — the reference (vectorized numpy, CPU);
* :func:`row_ids_torch` — the same arithmetic in torch, for CPU and CUDA
  tensors, so GPU workers hash on the device. Tests hold it equal to the
  reference on random batches.

Both take a *batch of variable-length requests*: flat ``tokens`` ``[T]``,
``cu_seqlens`` ``[B + 1]`` (request b owns ``tokens[cu[b]:cu[b+1]]``) and an
optional ``history`` ``[B, max_ngram - 1]`` (or wider: only its last ``max_ngram - 1``
columns are read) holding, oldest first, the request's compressed tokens just before
this batch (``pad_id`` where the request had none). With history a one-token decode step hashes exactly like the same
position inside prefill. ``-1`` marks a blocked token (an image span): it and
every older token of the suffix hash as ``pad_id``.

Engines give the tokens before a chunk as ``lookback`` ``[B, k]`` (k <= max_ngram - 1)
instead: request b's ids at positions ``start_b - 1 - j``, newest first, ``-1`` where
there is none (before the request's start). This is the stateless form (vLLM's
``lookback_token_ids``): a prefix-cache hit, a chunk of a chunked prefill or a
resumed request hashes by position. A ``-1`` in ``lookback`` hashes as ``pad_id``
without blocking older entries, exactly as vLLM's kernel does; mark a blocked
lookback token by writing ``-1`` from it on (or, with raw ids, by the image id).

With ``raw`` (a :class:`~engram_store.models.tokens.RawIds`) tokens and lookback are raw
token ids, compressed through the table set's map under its image rule.

A spec with ``boundary = "eos"`` (Qwen4Exp, raw ids, ``pad_id`` its EOS) hashes as vLLM's
``ple_ngram_ids`` does: no -1; the current token is always kept; look-back tokens at or beyond
the first EOS looking back, and positions before the request's start (history and lookback
fill), hash as EOS. ``history`` is then vLLM's ``ngram_context`` row as it is.

A spec with ``boundary = "eos_cut"`` and ``hash_rule = "poly_mod"`` (LongCat, raw ids, ``pad_id``
its EOS) hashes as vLLM's ``ngram_compute_n_gram_ids`` over ``LongcatNgramModelState``'s token
table: the gram of order n is the current token and up to n - 1 tokens back, cut (never padded)
at the request's start and at the first EOS looking back; an EOS current token gives the table's
offset (``eos_current = "offset"``, vLLM 0.33) or is hashed with its look-back (``"rehash"``,
SGLang 0.5.23). A negative ``history`` entry is a cut too, so vLLM's ``token_context`` row (-1 for
none, EOS negated) may be passed as it is.

The result is int64 ``[T, len(orders) * heads]`` global row ids in
(order, head) order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidRequest
from .spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from .tokens import RawIds

BLOCKED = -1
CUT = -1  # boundary "eos_cut": the suffix token where the gram has ended


def _check_batch(spec: ModelSpec, T: int, cu: np.ndarray, history_shape: tuple[int, ...] | None) -> None:
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or cu[-1] != T or (np.diff(cu) < 0).any():
        raise InvalidRequest(f"cu_seqlens must rise from 0 to len(tokens)={T}, got {cu.tolist()[:8]}")
    B = cu.size - 1
    if history_shape is not None and (len(history_shape) != 2 or history_shape[0] != B
                                      or history_shape[1] < spec.history_len):
        raise InvalidRequest(f"history must have shape [{B}, k >= {spec.history_len}], got {list(history_shape)}")


def _check_ids(spec: ModelSpec, name: str, lo: int, hi: int) -> None:
    if spec.boundary == "eos_cut" and name == "history":  # negative: a cut (vLLM's token_context)
        if lo < -spec.compressed_vocab or hi >= spec.compressed_vocab:
            raise InvalidRequest(f"history must be token ids in [0, {spec.compressed_vocab}) or negative (a "
                                 f"boundary, >= -{spec.compressed_vocab}), got values in [{lo}, {hi}]")
    elif spec.boundary != "blocked":
        if lo < 0 or hi >= spec.compressed_vocab:
            raise InvalidRequest(f"{name} must be token ids in [0, {spec.compressed_vocab}), got values in [{lo}, {hi}]")
    elif lo < BLOCKED or hi >= spec.compressed_vocab:
        raise InvalidRequest(f"{name} must be compressed ids in [0, {spec.compressed_vocab}) or -1 (blocked), "
                             f"got values in [{lo}, {hi}]")


# --------------------------------------------------------------------------- numpy reference
def _segments_numpy(spec: ModelSpec, tokens: np.ndarray, cu: np.ndarray, history: np.ndarray | None):
    """``ext``: per request its history then its tokens, concatenated; ``pos``: index of each token in ext."""
    H = spec.history_len if history is None else history.shape[1]
    B = cu.size - 1
    T = tokens.size
    req = np.repeat(np.arange(B, dtype=np.int64), np.diff(cu))
    pos = np.arange(T, dtype=np.int64) + H * (req + 1)
    ext = np.empty(T + B * H, dtype=np.int64)
    ext[pos] = tokens
    hist_pos = (cu[:-1] + H * np.arange(B, dtype=np.int64))[:, None] + np.arange(H, dtype=np.int64)
    ext[hist_pos] = spec.pad_id if history is None else history
    return ext, pos


def _as_batch_numpy(spec, tokens, cu_seqlens, history):
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    cu = np.array([0, tokens.size], dtype=np.int64) if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
    hist = None if history is None else np.asarray(history, dtype=np.int64)
    _check_batch(spec, tokens.size, cu, None if hist is None else hist.shape)
    if tokens.size:
        _check_ids(spec, "tokens", int(tokens.min()), int(tokens.max()))
    if hist is not None and hist.size:
        _check_ids(spec, "history", int(hist.min()), int(hist.max()))
    return tokens, cu, hist


def suffix_tokens_numpy(spec: ModelSpec, tokens, cu_seqlens=None, history=None) -> np.ndarray:
    """int64 ``[T, max_ngram]``: ``tok[t, k] = x'(t - k)`` with pad for missing or blocked."""
    tokens, cu, hist = _as_batch_numpy(spec, tokens, cu_seqlens, history)
    ext, pos = _segments_numpy(spec, tokens, cu, hist)
    tok = ext[pos[:, None] - np.arange(spec.max_ngram, dtype=np.int64)]
    if spec.boundary == "eos_cut":  # CUT from the first boundary on
        stop = (tok < 0) | (tok == spec.pad_id)
        if spec.eos_current == "rehash":
            stop[:, 0] = False
        tok[np.logical_or.accumulate(stop, axis=1)] = CUT
        return tok
    if spec.boundary == "eos":  # the current token is kept; EOS ends the look-back
        blocked = np.logical_or.accumulate(tok[:, 1:] == spec.pad_id, axis=1)
        tok[:, 1:][blocked] = spec.pad_id
        return tok
    blocked = np.logical_or.accumulate(tok == BLOCKED, axis=1)
    return np.where(blocked, spec.pad_id, tok)


def _gram_weights(spec: ModelSpec, layer: int) -> np.ndarray:
    """poly_mod: ``spec.poly_weights(layer)`` with 0 for the tokens beyond each order's gram, so a
    gram sums all ``max_ngram`` columns (a CUT column, clamped to 0, adds 0 as well)."""
    within = np.arange(spec.max_ngram) < np.asarray(spec.orders)[:, None]  # [O, N]
    return spec.poly_weights(layer) * within[:, None, :]


def hash_suffix_numpy(spec: ModelSpec, layer: int, tok: np.ndarray) -> np.ndarray:
    """Row ids ``[T, rows_per_token]`` of suffix tokens ``tok`` ``[T, max_ngram]``."""
    if spec.hash_rule == "poly_mod":  # tokens < 2**31, weights < size < 2**31: products never wrap
        sizes = spec.sizes(layer)
        terms = np.maximum(tok, 0)[:, None, None, :] * _gram_weights(spec, layer) % sizes[:, :, None]
        rows = terms.sum(axis=3) % sizes + spec.offsets(layer)
        return rows.reshape(tok.shape[0], spec.rows_per_token)
    mix = np.bitwise_xor.accumulate(tok * spec.multipliers_array(layer), axis=1)  # mix of order n: column n-1
    orders = np.asarray(spec.orders) - 1
    rows = mix[:, orders, None] % spec.primes(layer) + spec.offsets(layer)
    return rows.reshape(tok.shape[0], spec.rows_per_token)


def history_from_lookback_numpy(spec: ModelSpec, lookback, raw: "RawIds | None" = None) -> np.ndarray:
    """``history`` (oldest first, pad where none, -1 blocked) from ``lookback`` ``[B, k]`` (newest first, -1 none)."""
    lb = np.asarray(lookback, dtype=np.int64)
    if lb.ndim != 2 or lb.shape[1] > spec.history_len:
        raise InvalidRequest(f"lookback must have shape [B, k] with k <= {spec.history_len}, got {list(lb.shape)}")
    if raw is not None:
        comp = raw.compress_numpy(lb, none=spec.pad_id)
    else:
        given = lb[lb != BLOCKED] if spec.boundary != "blocked" else lb  # -1: before the start, under any rule
        if given.size:
            _check_ids(spec, "lookback", int(given.min()), int(given.max()))
        comp = np.where(lb == BLOCKED, spec.pad_id, lb)
    hist = np.full((lb.shape[0], spec.history_len), spec.pad_id, dtype=np.int64)
    hist[:, spec.history_len - lb.shape[1]:] = comp[:, ::-1]
    return hist


def _prepare_numpy(spec, tokens, history, lookback, raw):
    if history is not None and lookback is not None:
        raise InvalidRequest("give history or lookback, not both")
    if lookback is not None:
        history = history_from_lookback_numpy(spec, lookback, raw)
    if raw is not None:
        tokens = raw.compress_numpy(np.asarray(tokens, dtype=np.int64).reshape(-1))
    return tokens, history


def row_ids_numpy(spec: ModelSpec, layer: int, tokens, cu_seqlens=None, history=None, *, lookback=None,
                  raw: "RawIds | None" = None) -> np.ndarray:
    """Reference row ids, int64 ``[T, rows_per_token]``."""
    tokens, history = _prepare_numpy(spec, tokens, history, lookback, raw)
    return hash_suffix_numpy(spec, layer, suffix_tokens_numpy(spec, tokens, cu_seqlens, history))


def row_ids(spec: ModelSpec, layer: int, tokens, cu_seqlens=None, lookback=None, *, raw: "RawIds | None" = None):
    """The stateless primitive: row ids of a batch of chunks from their tokens and lookback (numpy reference)."""
    return row_ids_numpy(spec, layer, tokens, cu_seqlens, lookback=lookback, raw=raw)


def next_history_numpy(spec: ModelSpec, tokens, cu_seqlens=None, history=None) -> np.ndarray:
    """Each request's history after this batch: its last tokens (as many as ``history`` has
    columns, ``max_ngram - 1`` without one), oldest first."""
    tokens, cu, hist = _as_batch_numpy(spec, tokens, cu_seqlens, history)
    ext, _ = _segments_numpy(spec, tokens, cu, hist)
    H = spec.history_len if hist is None else hist.shape[1]
    end = cu[1:] + H * np.arange(1, cu.size, dtype=np.int64)
    return ext[end[:, None] - H + np.arange(H, dtype=np.int64)]


# --------------------------------------------------------------------------- torch (CPU and CUDA)
def _segments_torch(spec: ModelSpec, tokens: "torch.Tensor", cu: "torch.Tensor", history: "torch.Tensor | None"):
    import torch

    H = spec.history_len if history is None else history.shape[1]
    B = cu.numel() - 1
    T = tokens.numel()
    dev = tokens.device
    lengths = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(B, device=dev), lengths, output_size=T)
    pos = torch.arange(T, device=dev) + H * (req + 1)
    ext = torch.empty(T + B * H, dtype=torch.int64, device=dev)
    ext[pos] = tokens
    hist_pos = (cu[:-1] + H * torch.arange(B, device=dev))[:, None] + torch.arange(H, device=dev)
    if history is None:
        ext[hist_pos.reshape(-1)] = spec.pad_id
    else:
        ext[hist_pos.reshape(-1)] = history.reshape(-1)
    return ext, pos


def _as_batch_torch(spec, tokens, cu_seqlens, history, validate: bool):
    import torch

    tokens = torch.as_tensor(tokens).reshape(-1).to(torch.int64)
    dev = tokens.device
    if cu_seqlens is None:
        cu = torch.tensor([0, tokens.numel()], dtype=torch.int64, device=dev)
    else:
        cu = torch.as_tensor(cu_seqlens).to(device=dev, dtype=torch.int64)
    hist = None if history is None else torch.as_tensor(history).to(device=dev, dtype=torch.int64)
    if validate:  # costs a device sync on CUDA; callers that produce ids themselves may skip it
        _check_batch(spec, tokens.numel(), cu.cpu().numpy(), None if hist is None else tuple(hist.shape))
        for name, t in (("tokens", tokens), ("history", hist)):
            if t is not None and t.numel():
                _check_ids(spec, name, int(t.min()), int(t.max()))
    return tokens, cu, hist


def suffix_tokens_torch(spec: ModelSpec, tokens, cu_seqlens=None, history=None, *, validate: bool = True):
    """Torch twin of :func:`suffix_tokens_numpy`, on the tokens' device."""
    import torch

    tokens, cu, hist = _as_batch_torch(spec, tokens, cu_seqlens, history, validate)
    ext, pos = _segments_torch(spec, tokens, cu, hist)
    tok = ext[pos[:, None] - torch.arange(spec.max_ngram, device=tokens.device)]
    if spec.boundary == "eos_cut":  # CUT from the first boundary on
        stop = (tok < 0) | (tok == spec.pad_id)
        if spec.eos_current == "rehash":
            stop[:, 0] = False
        return torch.where(torch.cummax(stop.to(torch.int8), dim=1).values.bool(), CUT, tok)
    if spec.boundary == "eos":  # the current token is kept; EOS ends the look-back
        blocked = torch.cummax((tok[:, 1:] == spec.pad_id).to(torch.int8), dim=1).values.bool()
        tok[:, 1:] = torch.where(blocked, torch.full_like(tok[:, 1:], spec.pad_id), tok[:, 1:])
        return tok
    blocked = torch.cummax((tok == BLOCKED).to(torch.int8), dim=1).values.bool()
    return torch.where(blocked, torch.full_like(tok, spec.pad_id), tok)


_DEVICE_CONSTANTS: dict[tuple, tuple] = {}  # (spec geometry, layer, device) -> (multipliers or weights, sizes, offsets)


def _layer_constants(spec: ModelSpec, layer: int, dev) -> tuple:
    """A layer's multipliers (poly_mod: weights), sizes and offsets on ``dev``, made once per (spec, layer, device):
    building them per call is three host-to-device copies per layer per step, each waiting for
    the GPU queue, which would undo the layer-ahead overlap."""
    key = (spec.name, spec.table_base, spec.orders, spec.heads, spec.multipliers[layer], spec.size_rule,
           spec.hash_rule, layer, str(dev))
    found = _DEVICE_CONSTANTS.get(key)
    if found is None:
        import torch

        weights = _gram_weights(spec, layer) if spec.hash_rule == "poly_mod" else spec.multipliers_array(layer)
        found = (torch.tensor(weights, device=dev), torch.tensor(spec.sizes(layer), device=dev),
                 torch.tensor(spec.offsets(layer), device=dev))
        _DEVICE_CONSTANTS[key] = found
    return found


def hash_suffix_torch(spec: ModelSpec, layer: int, tok: "torch.Tensor") -> "torch.Tensor":
    import torch

    multipliers, primes, offsets = _layer_constants(spec, layer, tok.device)
    if spec.hash_rule == "poly_mod":  # multipliers: the gram weights [O, H, N]
        terms = torch.remainder(tok.clamp(min=0)[:, None, None, :] * multipliers, primes[:, :, None])
        rows = torch.remainder(terms.sum(dim=3), primes) + offsets
        return rows.reshape(tok.shape[0], spec.rows_per_token)
    prod = tok * multipliers
    mix = [prod[:, 0]]
    for k in range(1, spec.max_ngram):  # over look-back positions (<= 3), not tokens
        mix.append(mix[-1] ^ prod[:, k])
    orders = torch.stack([mix[n - 1] for n in spec.orders], dim=1)  # [T, n_orders]
    rows = torch.remainder(orders[:, :, None], primes) + offsets
    return rows.reshape(tok.shape[0], spec.rows_per_token)


def history_from_lookback_torch(spec: ModelSpec, lookback: "torch.Tensor", raw: "RawIds | None" = None,
                                raw_table: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Torch twin of :func:`history_from_lookback_numpy` (no validation: check on the host first)."""
    import torch

    lb = lookback.to(torch.int64)
    if raw is not None:
        comp = raw.compress_torch(raw_table, lb, none=spec.pad_id)
    else:
        comp = torch.where(lb == BLOCKED, spec.pad_id, lb)
    hist = torch.full((lb.shape[0], spec.history_len), spec.pad_id, dtype=torch.int64, device=lb.device)
    hist[:, spec.history_len - lb.shape[1]:] = comp.flip(1)
    return hist


def row_ids_torch(spec: ModelSpec, layer: int, tokens, cu_seqlens=None, history=None, *, lookback=None,
                  raw: "RawIds | None" = None, raw_table: "torch.Tensor | None" = None, validate: bool = True):
    """Row ids as an int64 tensor ``[T, rows_per_token]`` on the tokens' device.

    ``raw_table``: ``raw.device_table(device)``, made once by callers that hash many batches.
    """
    import torch

    tokens = torch.as_tensor(tokens).reshape(-1).to(torch.int64)
    if history is not None and lookback is not None:
        raise InvalidRequest("give history or lookback, not both")
    if raw is not None and raw_table is None:
        raw_table = raw.device_table(tokens.device)
    if lookback is not None:
        lookback = torch.as_tensor(lookback).to(device=tokens.device, dtype=torch.int64)
        if validate:  # on the host, as the reference does
            history_from_lookback_numpy(spec, lookback.cpu().numpy(), raw)
        history = history_from_lookback_torch(spec, lookback, raw, raw_table)
    if raw is not None:
        if validate:
            raw.check("raw ids", tokens.cpu().numpy())
        tokens = raw.compress_torch(raw_table, tokens)
    return hash_suffix_torch(spec, layer, suffix_tokens_torch(spec, tokens, cu_seqlens, history, validate=validate))


def next_history_torch(spec: ModelSpec, tokens, cu_seqlens=None, history=None, *, validate: bool = True):
    """Torch twin of :func:`next_history_numpy`."""
    import torch

    tokens, cu, hist = _as_batch_torch(spec, tokens, cu_seqlens, history, validate)
    ext, _ = _segments_torch(spec, tokens, cu, hist)
    H = spec.history_len if hist is None else hist.shape[1]
    end = cu[1:] + H * torch.arange(1, cu.numel(), device=tokens.device)
    return ext[end[:, None] - H + torch.arange(H, device=tokens.device)]
