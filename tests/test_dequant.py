"""dequantize against a float64 reference that decodes FP8 e4m3fn bits by hand (no torch float8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_store import get_spec
from engram_store.errors import InvalidRequest
from engram_store.models.spec import RowFormat
from engram_store.tools.synth import synth_rows
from gpu_client import dequantize


def e4m3fn_reference(codes: np.ndarray) -> np.ndarray:
    """float64 value of e4m3fn bytes: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * 2.0 ** -6
    value = sign * np.where(exp == 0, subnormal, normal)
    return np.where((codes & 0x7F) == 0x7F, np.nan, value)


def reference(rows: np.ndarray, fmt: RowFormat) -> np.ndarray:
    """float64 ``[T, R * dim]``."""
    T, R, _ = rows.shape
    values = e4m3fn_reference(rows[..., : fmt.dim]).reshape(T, R, fmt.scale_count, fmt.scale_block)
    scale_bytes = rows[..., fmt.dim:].astype(np.float64)
    scales = np.where(scale_bytes == 255, np.nan, np.exp2(scale_bytes - 127.0))
    return (values * scales[..., None]).reshape(T, R * fmt.dim)


def assert_matches(got: torch.Tensor, rows: np.ndarray, fmt: RowFormat) -> None:
    want = torch.from_numpy(reference(rows, fmt)).to(torch.bfloat16)  # float64 -> bf16: one rounding
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.to(torch.float64).numpy(), want.to(torch.float64).numpy()
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])


def test_reference_decoder_known_values():
    codes = np.array([0x00, 0x80, 0x38, 0xB8, 0x7E, 0x01, 0x08, 0x40, 0x7F, 0xFF])
    want = [0.0, -0.0, 1.0, -1.0, 448.0, 2.0 ** -9, 2.0 ** -6, 2.0, np.nan, np.nan]
    np.testing.assert_array_equal(e4m3fn_reference(codes), want)


def test_every_code_with_every_scale():
    """All 256 payload codes against every E8M0 scale byte, including 0, 127, 254 and NaN (255)."""
    fmt = RowFormat(dim=256, scale_block=32)
    payload = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row i: all codes
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], fmt.scale_count, axis=1)  # row i: scale byte i
    scales[:, 1] = 127
    rows = np.concatenate([payload, scales], axis=1).reshape(256, 1, fmt.row_bytes)
    assert_matches(dequantize(torch.from_numpy(rows), fmt), rows, fmt)


@pytest.mark.parametrize("name", ["tiny", "deepseek-v4.1-flash"])
def test_synthetic_rows(name):
    spec = get_spec(name)
    rows = synth_rows(spec, 3, spec.layers[0], np.arange(40 * spec.rows_per_token)).reshape(
        40, spec.rows_per_token, spec.row_bytes)
    got = dequantize(torch.from_numpy(rows), spec)
    assert tuple(got.shape) == (40, spec.rows_per_token * spec.row_format.dim)
    assert_matches(got, rows, spec.row_format)
    assert torch.isfinite(got).all()


def test_random_bytes_into_out_buffer():
    spec = get_spec("tiny")
    rows = np.random.default_rng(0).integers(0, 256, size=(17, spec.rows_per_token, spec.row_bytes), dtype=np.uint8)
    out = torch.empty(17, spec.rows_per_token * spec.row_format.dim, dtype=torch.bfloat16)
    assert dequantize(torch.from_numpy(rows), spec, out=out) is out
    assert_matches(out, rows, spec.row_format)


def test_a_view_of_a_larger_buffer():
    spec = get_spec("tiny")
    big = np.random.default_rng(1).integers(0, 120, size=(32, spec.rows_per_token, spec.row_bytes), dtype=np.uint8)
    assert_matches(dequantize(torch.from_numpy(big)[:5], spec), big[:5], spec.row_format)


def test_bad_input():
    spec = get_spec("tiny")
    with pytest.raises(InvalidRequest):
        dequantize(torch.zeros(2, 12, 65, dtype=torch.uint8), spec)
    with pytest.raises(InvalidRequest):
        dequantize(torch.zeros(2, 12, 66, dtype=torch.int16), spec)
    with pytest.raises(InvalidRequest):
        dequantize(torch.zeros(2, 12, 66, dtype=torch.uint8), spec, out=torch.empty(2, 768, dtype=torch.float32))
    with pytest.raises(InvalidRequest):
        dequantize(torch.zeros(2, 12, 66, dtype=torch.uint8), "tiny")


def test_bf16_rows_are_their_values():
    """LongCat's and Qwen4Exp-BF16's rows: bf16 bits as they are (the reference reads them as float32's top half)."""
    spec = get_spec("longcat-flash-lite", 0.0005)
    rows = synth_rows(spec, 3, 0, np.arange(30 * spec.rows_per_token)).reshape(30, spec.rows_per_token, spec.row_bytes)
    bits = rows.view("<u2").astype(np.uint32) << 16
    want = torch.from_numpy(bits.view(np.float32).reshape(30, -1).copy()).to(torch.bfloat16)
    got = dequantize(torch.from_numpy(rows), spec)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp8_rows_times_the_table_scale():
    """Qwen4Exp's FP8 rows (no block scales) times the table's one scale, every code."""
    spec = get_spec("qwen3.8-flash-next", 0.0002)
    fmt = spec.row_format
    assert not fmt.scale_block and fmt.table_scale_dtype and fmt.row_bytes == 160
    rows = np.resize(np.arange(256, dtype=np.uint8), 4 * 16 * 160).reshape(4, 16, 160)
    scale = 7 / 512
    got = dequantize(torch.from_numpy(rows), spec, table_scale=scale)
    want = torch.from_numpy(e4m3fn_reference(rows).reshape(4, -1) * scale).to(torch.bfloat16)
    g, w = got.to(torch.float64).numpy(), want.to(torch.float64).numpy()
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])
    with pytest.raises(InvalidRequest, match="table_scale"):
        dequantize(torch.from_numpy(rows), spec)


def test_nvfp4_rows_are_refused():
    spec = get_spec("qwen3.8-flash-next-nvfp4", 0.0002)
    rows = torch.zeros(2, 16, spec.row_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidRequest, match="float4_e2m1fn"):
        dequantize(rows, spec, table_scale=1.0)
