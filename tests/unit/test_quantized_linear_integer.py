"""vmesh/kernels/cpu/integer_linear.c (`--weights native` on int8 dot products) against a float64
reference of what it computes: the dequantized weight times the activations rounded to int8 per
block of 32 (scale max |x| / 127, ties to even), written here from that definition. Every block's
integer sum is exact in the kernel, so only float32 accumulation separates the two."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.gguf_blocks import FORMATS, Q4_1, random_blocks
from tests.unit.test_quantized_linear import layer, shapes_of
from vmesh.kernels.cpu_native import QUANTIZED_FORMATS
from vmesh.services.worker.quantized_linear import (
    DOT_ENV,
    QuantizedLinear,
    QuantizedWeight,
    integer_dot_chosen,
    log_placement,
)


@pytest.fixture()
def integer_kernels(kernels, monkeypatch):
    if not kernels.integer_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: the float32 kernel serves (test_forced_fallback covers it)")
    monkeypatch.delenv(DOT_ENV, raising=False)
    return kernels


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each row's blocks of 32 rounded to int8 codes times their float32 scale."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((blocks * inverse).round() * scale).reshape(x.shape)


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return int8_rounded(x).double() @ weight.double().T + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 17, 64, 256])
def test_kernel_matches_int8_rounded_reference(integer_kernels, name, rows):
    # 203 outputs: off every multiple of 4 and 16; 19 blocks: a block pair left half empty (K-quants:
    # 3 super-blocks, 12 pairs of sub-blocks).
    in_features = 608 if QUANTIZED_FORMATS[FORMATS[name]].block_values == 32 else 768
    linear, weight, b = layer(FORMATS[name], 203, in_features, integer_kernels, bias=rows % 2 == 1, seed=rows)
    assert linear.integer
    x = torch.randn(rows, in_features) * torch.linspace(0.01, 4, in_features)  # blocks of very different scales
    x[0, :32] = 0  # an all-zero block: scale 0
    got = linear(x)
    assert got.shape == (rows, 203) and got.dtype == torch.float32
    want = expected(x, weight, b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * float(want.abs().max()))


@pytest.mark.parametrize("shape", range(4))
@pytest.mark.parametrize("rows", [1, 4, 6, 7])
def test_odd_shapes(integer_kernels, shape, rows):
    for name, block_format in FORMATS.items():
        out_features, in_features = shapes_of(name, [(1, 32), (7, 64), (65, 96), (130, 1536)],
                                              [(1, 256), (7, 512), (65, 256), (130, 2048)])[shape]
        linear, weight, b = layer(block_format, out_features, in_features, integer_kernels, bias=True, seed=rows)
        x = torch.randn(rows, in_features)
        want = expected(x, weight, b)
        torch.testing.assert_close(linear(x).double(), want, rtol=1e-5, atol=2e-5 * float(want.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_threads_agree(integer_kernels):
    linear, _, _ = layer(Q4_1, 70, 96, integer_kernels, bias=True)
    previous = torch.get_num_threads()
    try:
        for rows in (3, 40):
            x = torch.randn(rows, 96)
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                results.append(linear(x))
            # Each output is one thread's sum in a fixed order: the split changes nothing.
            assert all(torch.equal(results[0], other) for other in results[1:])
    finally:
        torch.set_num_threads(previous)


def test_integer_is_close_to_float32(integer_kernels):
    """The int8 rounding of the activations costs about 1 % of the output's scale, no more."""
    linear, weight, _ = layer(Q4_1, 64, 576, integer_kernels, bias=False)
    x = torch.randn(8, 576)
    exact = x.double() @ weight.double().T
    error = (linear(x).double() - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.02


@pytest.mark.parametrize("name", FORMATS)
def test_forced_fallback(kernels, monkeypatch, caplog, name):
    """DOT_ENV=float keeps the float32 kernel, as on a CPU without VNNI: bit for bit its output."""
    monkeypatch.setenv(DOT_ENV, "float")
    block_format, in_features = FORMATS[name], QUANTIZED_FORMATS[FORMATS[name]].block_values * 2
    raw = torch.from_numpy(random_blocks(block_format, 33, in_features))
    linear = QuantizedLinear(QuantizedWeight(raw, block_format, in_features), None, kernels)
    assert not linear.integer and not integer_dot_chosen(kernels)
    x = torch.randn(5, in_features)
    assert torch.equal(linear(x), kernels.quantized_linear(x, raw, block_format, in_features, None))
    with caplog.at_level(logging.INFO, logger="vmesh.services.worker.quantized_linear"):
        log_placement([linear], {})
    assert "float32 products" in caplog.text and "int8" not in caplog.text
    monkeypatch.setenv(DOT_ENV, "fast")
    with pytest.raises(ValueError, match=f"{DOT_ENV} must be one of int8, float"):
        integer_dot_chosen(kernels)


def test_path_is_logged(integer_kernels, caplog):
    linear, _, _ = layer(Q4_1, 16, 64, integer_kernels, bias=False)
    with caplog.at_level(logging.INFO, logger="vmesh.services.worker.quantized_linear"):
        log_placement([linear], {})
    assert "int8 dot products (AVX-512 VNNI)" in caplog.text
