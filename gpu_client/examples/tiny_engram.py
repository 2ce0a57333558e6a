"""A tiny Engram model end to end: transformer blocks, Engram at the spec's layers, rows from a prefetcher.

Blocks are pre-norm (RMSNorm, causal multi-head attention within each request's
tokens of the step, SwiGLU MLP). At an Engram layer the rows of every position
are dequantized, concatenated (``rows_per_token * dim`` values) and fused with a
gate, as in the Engram paper::

    e = dequantize(rows); k = e W_k; v = e W_v
    gate = sigmoid(<rmsnorm(h), rmsnorm(k)> / sqrt(hidden))
    h = h + gate * v

Weights come from a seed, so two processes build the same model. The rows come
from an :class:`~gpu_client.EngramPrefetcher` over any client, which is how the
logits are shown identical with tables in process memory and through the daemon::

    python -m gpu_client.examples.tiny_engram --tables DIR                    # in process
    python -m gpu_client.examples.tiny_engram --tables DIR --daemon unix:///run/engram.sock

(The attention sees only the current step's tokens of a request; a KV cache is
beside the point here, Engram's history is what carries across steps.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np
import torch
from torch import nn

from engram_store.models.spec import ModelSpec
from gpu_client.dequant import dequantize
from gpu_client.prefetch import EngramPrefetcher, Step

RowSource = Callable[[int], torch.Tensor]  # Engram layer -> uint8 rows [T, rows_per_token, row_bytes]


@dataclass(frozen=True)
class TinyConfig:
    hidden: int = 256
    blocks: int = 4
    heads: int = 4
    mlp: int = 512
    seed: int = 0


def _rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class TinyEngramModel(nn.Module):
    def __init__(self, spec: ModelSpec, config: TinyConfig = TinyConfig()) -> None:
        super().__init__()
        if config.blocks <= spec.layers[-1] or config.hidden % config.heads:
            raise ValueError(f"need more than {spec.layers[-1]} blocks and hidden divisible by heads, got {config}")
        self.spec, self.config = spec, config
        g = torch.Generator().manual_seed(config.seed)
        d, m, e = config.hidden, config.mlp, spec.rows_per_token * spec.row_format.dim

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[0]), requires_grad=False)

        self.embed = nn.Parameter(torch.randn(spec.compressed_vocab, d, generator=g) * 0.5, requires_grad=False)
        self.qkv = nn.ParameterList(w(d, 3 * d) for _ in range(config.blocks))
        self.proj = nn.ParameterList(w(d, d) for _ in range(config.blocks))
        self.up = nn.ParameterList(w(d, 2 * m) for _ in range(config.blocks))
        self.down = nn.ParameterList(w(m, d) for _ in range(config.blocks))
        self.engram_k = nn.ParameterDict({str(layer): w(e, d) for layer in spec.layers})
        self.engram_v = nn.ParameterDict({str(layer): w(e, d) for layer in spec.layers})
        self.head = w(d, spec.compressed_vocab)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, rows: RowSource) -> torch.Tensor:
        """float32 logits ``[T, compressed_vocab]``; ``rows(layer)`` is called when block ``layer`` runs."""
        device = self.embed.device
        tokens = tokens.to(device=device, dtype=torch.int64).clamp_min(0)  # blocked positions (-1) embed as token 0
        h = self.embed[tokens]
        mask, gather, scatter = (t.to(device, non_blocking=True) for t in self._layout(cu_seqlens.cpu()))
        for i in range(self.config.blocks):
            h = h + self._attention(_rmsnorm(h), i, mask, gather, scatter)
            if i in self.spec.layers:
                h = h + self._engram(h, rows(i), str(i))
            a, b = (_rmsnorm(h) @ self.up[i]).chunk(2, dim=-1)
            h = h + (nn.functional.silu(a) * b) @ self.down[i]
        return _rmsnorm(h) @ self.head

    def _engram(self, h: torch.Tensor, rows: torch.Tensor, layer: str) -> torch.Tensor:
        e = dequantize(rows, self.spec).to(h.dtype)
        k, v = e @ self.engram_k[layer], e @ self.engram_v[layer]
        gate = torch.sigmoid((_rmsnorm(h) * _rmsnorm(k)).sum(-1, keepdim=True) / math.sqrt(h.shape[-1]))
        return gate * v

    def _layout(self, cu: torch.Tensor):
        """Padded [B, L] layout of the step: (attention mask, flat index per padded slot, padded slot per token)."""
        cu = cu.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        B, L = lengths.numel(), max(int(lengths.max()) if lengths.numel() else 0, 1)
        req = torch.repeat_interleave(torch.arange(B), lengths)
        pos = torch.arange(int(cu[-1])) - cu[:-1][req]
        scatter = req * L + pos
        valid = torch.arange(L)[None, :] < lengths[:, None]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = causal[None, :, :] & valid[:, None, :]
        return mask[:, None], torch.clamp_max(cu[:-1][:, None] + torch.arange(L)[None, :], int(cu[-1]) - 1), scatter

    def _attention(self, x, i, mask, gather, scatter):
        B, L = gather.shape
        H, d = self.config.heads, self.config.hidden
        q, k, v = (x @ self.qkv[i])[gather].view(B, L, 3, H, d // H).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(B * L, d)[scatter] @ self.proj[i]


def prefill(model: TinyEngramModel, pf: EngramPrefetcher, chunks: Sequence[Step], *, lookahead: bool = True):
    """Run prefill chunks; with ``lookahead`` chunk k+1 is submitted before chunk k computes. Yields logits."""
    futures = [pf.submit(chunks[0])] if chunks else []
    for k, step in enumerate(chunks):
        if lookahead and k + 1 < len(chunks):
            futures.append(pf.submit(chunks[k + 1]))
        elif not lookahead and k > 0:
            futures.append(pf.submit(step))
        yield model(torch.from_numpy(step.tokens), torch.from_numpy(step.cu_seqlens), futures[k].wait)


def decode(model: TinyEngramModel, pf: EngramPrefetcher, request_ids: Sequence[Hashable], first: np.ndarray,
           steps: int):
    """Greedy decode: each step's tokens are the argmax of the previous step's logits. Yields logits."""
    tokens = np.asarray(first, dtype=np.int64)
    for k in range(steps):
        step = Step.decode(request_ids, tokens, finished=request_ids if k == steps - 1 else ())
        logits = model(torch.from_numpy(step.tokens), torch.from_numpy(step.cu_seqlens), pf.submit(step).wait)
        tokens = logits.argmax(-1).cpu().numpy()
        yield logits


def prompt_chunks(spec: ModelSpec, requests: int, prompt_len: int, chunk_tokens: int, seed: int) -> list[Step]:
    """Prompts of ``requests`` requests split into chunks of about ``chunk_tokens`` tokens (several requests each)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, spec.compressed_vocab, size=(requests, prompt_len))
    per_chunk = max(chunk_tokens // prompt_len, 1)
    if per_chunk > 1 or prompt_len <= chunk_tokens:
        groups = [range(s, min(s + per_chunk, requests)) for s in range(0, requests, per_chunk)]
        return [Step.from_lists([f"p{r}" for r in g], [prompts[r] for r in g]) for g in groups]
    return [Step.from_lists([f"p{r}"], [prompts[r, s: s + chunk_tokens]])
            for r in range(requests) for s in range(0, prompt_len, chunk_tokens)]


def _digest(chunks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> None:
    from engram_store.client.local import LocalClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", help="table set directory (in-process tables)")
    ap.add_argument("--daemon", help="daemon address, unix:///path or grpc://host:port")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--decode", type=int, default=8, help="decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if bool(args.tables) == bool(args.daemon):
        ap.error("give exactly one of --tables and --daemon")
    if args.daemon:
        from engram_store.client.client import EngramClient

        client = EngramClient.connect(args.daemon)
    else:
        client = LocalClient.open(args.tables)
    with EngramPrefetcher(client, device=args.device) as pf:
        model = TinyEngramModel(pf.spec, TinyConfig(seed=args.seed)).to(args.device)
        chunks = prompt_chunks(pf.spec, args.requests, args.prompt, 64, args.seed)
        logits = list(prefill(model, pf, chunks))
        ids = [f"p{r}" for r in range(args.requests)]
        first = np.random.default_rng(args.seed).integers(0, pf.spec.compressed_vocab, size=args.requests)
        logits += list(decode(model, pf, ids, first, args.decode))
        print(json.dumps({"path": pf.path, "steps": len(logits), "logits_sha256": _digest(logits)}))
    client.close()


if __name__ == "__main__":
    main()
