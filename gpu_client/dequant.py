"""Engram rows to bf16: FP8 e4m3fn payload times a power-of-two E8M0 scale per block (DeepSeek-V4.1); BF16
rows as they are (LongCat, Qwen4Exp's BF16 table); FP8 rows without block scales times the table's one scale
(Qwen4Exp's FP8 table: ``table_scale``, the daemon's ``table_scales``). NVFP4 rows are refused.

A row is ``dim`` payload bytes (FP8 e4m3fn values) followed by ``dim // scale_block``
scale bytes (E8M0: the value ``2^(byte - 127)``, 255 meaning NaN). The value of
payload ``i`` is ``fp8(payload[i]) * 2^(scale[i // scale_block] - 127)``.

The arithmetic is exact in float32 (an e4m3 value has 4 significant bits and the
smallest product, 2^-9 * 2^-127, is a float32 subnormal), so the only rounding is
the final cast to bf16. Works on any device torch supports float8 on (CPU, CUDA),
with fixed shapes and no host synchronization, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Union

from engram_store.errors import InvalidRequest
from engram_store.models.spec import ModelSpec, RowFormat

if TYPE_CHECKING:
    import torch

E8M0_BIAS = 127
E8M0_NAN = 255


def _row_format(spec_or_row_format: Union[ModelSpec, RowFormat]) -> RowFormat:
    if isinstance(spec_or_row_format, ModelSpec):
        return spec_or_row_format.row_format
    if isinstance(spec_or_row_format, RowFormat):
        return spec_or_row_format
    raise InvalidRequest(f"dequantize needs a ModelSpec or RowFormat, got {type(spec_or_row_format).__name__}")


@functools.cache
def _scale_table_cpu():
    """float32 ``[256]``: the value of every E8M0 byte (NaN for 255)."""
    import torch

    table = torch.ldexp(torch.ones(256, dtype=torch.float32), torch.arange(256, dtype=torch.int32) - E8M0_BIAS)
    table[E8M0_NAN] = float("nan")
    return table


_scale_tables: dict = {}


def _scale_table(device: "torch.device") -> "torch.Tensor":
    table = _scale_tables.get(device)
    if table is None:
        table = _scale_tables[device] = _scale_table_cpu().to(device)
    return table


def dequantize(rows: "torch.Tensor", spec_or_row_format: Union[ModelSpec, RowFormat],
               *, out: "torch.Tensor | None" = None, table_scale: float | None = None) -> "torch.Tensor":
    """bf16 ``[T, rows_per_token * dim]`` from uint8 rows ``[T, rows_per_token, row_bytes]``.

    ``out`` (bf16, that shape, same device) is filled and returned when given, so a
    caller with fixed-capacity buffers allocates nothing per step. ``table_scale``: a format with
    one scale per table (``table_scale_dtype``) needs it (``EngramStoreTables.table_scale`` or the
    daemon's Info ``table_scales``); the rows are multiplied by it in float32.
    """
    import torch

    fmt = _row_format(spec_or_row_format)
    if rows.dtype != torch.uint8 or rows.dim() != 3 or rows.shape[-1] != fmt.row_bytes:
        raise InvalidRequest(f"rows must be uint8 [T, rows_per_token, {fmt.row_bytes}], "
                             f"got {rows.dtype} {list(rows.shape)}")
    if fmt.table_scale_dtype and table_scale is None:
        raise InvalidRequest(f"{fmt.payload_dtype} rows with one scale per table: pass table_scale (the daemon's "
                             "table_scales)")
    T, R, _ = rows.shape
    if fmt.payload_dtype == "bfloat16" and not fmt.scale_block:
        product = rows.view(torch.bfloat16).to(torch.float32)
    elif fmt.payload_dtype == "float8_e4m3fn" and not fmt.scale_block:
        product = rows.view(torch.float8_e4m3fn).to(torch.float32)
    elif fmt.payload_dtype == "float8_e4m3fn" and fmt.scale_dtype == "float8_e8m0fnu":
        payload = rows[..., : fmt.dim].reshape(T, R, fmt.scale_count, fmt.scale_block)
        values = payload.view(torch.float8_e4m3fn).to(torch.float32)
        scales = _scale_table(rows.device)[rows[..., fmt.dim :].to(torch.int64)]  # [T, R, scale_count]
        product = values * scales[..., None]
    else:
        raise InvalidRequest(f"dequantize does not decode {fmt.payload_dtype} rows with {fmt.scale_dtype or 'no'} "
                             "block scales (BF16, FP8, and FP8 with E8M0 block scales only)")
    if table_scale is not None:
        product = product * torch.tensor(float(table_scale), dtype=torch.float32, device=rows.device)
    if out is None:
        return product.reshape(T, R * fmt.dim).to(torch.bfloat16)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (T, R * fmt.dim) or out.device != rows.device:
        raise InvalidRequest(f"out must be bf16 [{T}, {R * fmt.dim}] on {rows.device}, "
                             f"got {out.dtype} {list(out.shape)} on {out.device}")
    out.copy_(product.reshape(T, R * fmt.dim))
    return out
