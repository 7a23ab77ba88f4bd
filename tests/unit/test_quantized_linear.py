"""vmesh/kernels/cpu/quantized_linear.c against a float32 reference: for Q4_0, Q4_1 and Q8_0 written here
from GGUF's block definitions (independently of the kernel and of the gguf package, which is only a
cross-check); for Q5_0, Q4_K and Q6_K the gguf package's dequantize."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.gguf_blocks import FORMATS, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, random_blocks
from vmesh.kernels.cpu_native import QUANTIZED_FORMATS
from vmesh.services.worker.quantized_linear import DOT_ENV, QuantizedLinear, QuantizedWeight

OWN_REFERENCE = (Q4_0, Q4_1, Q8_0)  # dequantize_reference's formats


@pytest.fixture(autouse=True)
def float32_kernel(monkeypatch):
    """This module tests the float32 kernel, which multiplies the activations unrounded; the integer
    one (test_quantized_linear_integer.py) would otherwise serve on a CPU with VNNI."""
    monkeypatch.setenv(DOT_ENV, "float")


def gguf_dequantize(raw: np.ndarray, block_format: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType(block_format))


def dequantize_reference(raw: np.ndarray, block_format: int, in_features: int) -> np.ndarray:
    """From the format definitions: a float16 scale d (Q4_1: then a float16 offset m), then 32 codes;
    nibble formats hold feature j in byte j's low nibble and feature j + 16 in its high nibble."""
    blocks = raw.reshape(-1, QUANTIZED_FORMATS[block_format].block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if block_format == Q8_0:
        values = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    else:
        codes = blocks[:, 4:] if block_format == Q4_1 else blocks[:, 2:]
        nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=1).astype(np.float32)
        if block_format == Q4_1:
            values = nibbles * d + blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            values = (nibbles - 8) * d
    return values.reshape(raw.shape[0], in_features)


def layer(block_format: int, out_features: int, in_features: int, kernels, bias: bool, seed: int = 0):
    raw = random_blocks(block_format, out_features, in_features, seed)
    weight = QuantizedWeight(torch.from_numpy(raw), block_format, in_features)
    b = torch.randn(out_features) if bias else None
    reference = torch.from_numpy(dequantize_reference(raw, block_format, in_features) if block_format in OWN_REFERENCE
                                 else gguf_dequantize(raw, block_format).astype(np.float32))
    return QuantizedLinear(weight, b, kernels), reference, b


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_reference_agrees_with_the_gguf_package(name):
    raw = random_blocks(FORMATS[name], 7, 96)
    np.testing.assert_array_equal(dequantize_reference(raw, FORMATS[name], 96), gguf_dequantize(raw, FORMATS[name]))


def test_format_table_agrees_with_the_gguf_package():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for type_id, geometry in QUANTIZED_FORMATS.items():
        kind = GGMLQuantizationType(type_id)
        assert (kind.name, *GGML_QUANT_SIZES[kind]) == (geometry.name, geometry.block_values, geometry.block_bytes)


def shapes_of(name: str, shapes: list[tuple[int, int]], wide: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A K-quant's rows come in super-blocks of 256: `wide` (in a multiple of 256) for them."""
    return wide if QUANTIZED_FORMATS[FORMATS[name]].block_values == 256 else shapes


ROW_SHAPES = [(name, out_features, in_features) for name in FORMATS for out_features, in_features in
              shapes_of(name, [(1, 32), (37, 96), (203, 576), (70, 1536)], [(1, 256), (37, 512), (203, 1280)])]


@pytest.mark.parametrize(("name", "out_features", "in_features"), ROW_SHAPES)
def test_rows_are_the_reference_exactly(kernels, name, out_features, in_features):
    """Every dequantized value is exact in float32, so the embedding lookup path must be too."""
    linear, weight, _ = layer(FORMATS[name], out_features, in_features, kernels, bias=False)
    ids = torch.tensor([out_features - 1, 0, out_features // 2, 0], dtype=torch.int64)
    assert torch.equal(linear.weight_rows(ids), weight[ids])
    assert torch.equal(linear.dequantized(), weight)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 17, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32_reference(kernels, name, rows, bias):
    # out features off every multiple of 4, 16 and 64; in features a multiple of 32 only (K-quants: of 256,
    # an odd number of super-blocks).
    out_features, in_features = 203, 608 if QUANTIZED_FORMATS[FORMATS[name]].block_values == 32 else 768
    linear, weight, b = layer(FORMATS[name], out_features, in_features, kernels, bias, seed=rows)
    x = torch.randn(rows, in_features)
    expected = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    got = linear(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # float32 accumulation over 608 terms in another order than float64's.
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4 * float(expected.abs().max()))


def test_leading_dimensions_and_threads(kernels):
    linear, weight, b = layer(Q4_1, 65, 64, kernels, bias=True)
    x = torch.randn(2, 3, 64)
    expected = (x.reshape(-1, 64).double() @ weight.double().T + b.double()).reshape(2, 3, 65)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_refuses_bad_shapes(kernels):
    raw = torch.from_numpy(random_blocks(Q4_1, 8, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(raw, Q4_1, 48)
    with pytest.raises(ValueError, match="blocks must be"):
        kernels.quantized_linear(torch.randn(2, 64), raw[:, :-1].contiguous(), Q4_1, 64, None)
    with pytest.raises(ValueError, match="unsupported block format"):
        kernels.quantized_linear(torch.randn(2, 64), raw, 13, 64, None)  # Q5_K: no kernel reads it
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(torch.from_numpy(random_blocks(Q4_K, 2, 256))[:, :72].contiguous(), Q4_K, 128)
    with pytest.raises(ValueError, match="in_features must be"):
        kernels.quantized_linear(torch.randn(2, 48), raw, Q4_1, 48, None)
    linear = QuantizedLinear(QuantizedWeight(raw, Q4_1, 64), None, kernels)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        kernels.quantized_linear(torch.randn(2, 32), raw, Q4_1, 64, None)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.quantized_linear(torch.randn(2, 64), raw, Q4_1, 64, torch.zeros(7))
    with pytest.raises(ValueError, match="ids must lie"):
        linear.weight_rows(torch.tensor([8]))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.quantized_linear(torch.randn(64, 2).T, raw, Q4_1, 64, None)


def test_holds_only_the_quantized_bytes(kernels):
    linear, _, _ = layer(Q4_1, 64, 576, kernels, bias=False)
    assert linear.held_bytes() == {"quantized": 64 * 576 // 32 * 20}
    assert linear.weight is None and linear.rows_readable


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0"])
def test_widening_to_q8_0_is_exact(name):
    raw = random_blocks(FORMATS[name], 9, 96)
    widened = QuantizedWeight(torch.from_numpy(raw), FORMATS[name], 96).widened_to_q8_0()
    assert widened.block_format == Q8_0
    np.testing.assert_array_equal(gguf_dequantize(widened.blocks.numpy(), Q8_0), gguf_dequantize(raw, FORMATS[name]))


def test_join_stacks_parts_or_says_why_not():
    def weight(block_format: int, out_features: int, in_features: int = 256) -> QuantizedWeight:
        raw = random_blocks(block_format, out_features, in_features, seed=out_features)
        return QuantizedWeight(torch.from_numpy(raw), block_format, in_features)

    q, k, v = weight(Q5_0, 8), weight(Q5_0, 4), weight(Q8_0, 4)  # Gemma 3's q, k and v
    joined = QuantizedWeight.join([q, k, v])
    assert isinstance(joined, QuantizedWeight) and joined.block_format == Q8_0 and joined.out_features == 16
    expected = np.concatenate([gguf_dequantize(p.blocks.numpy(), p.block_format) for p in (q, k, v)])
    np.testing.assert_array_equal(gguf_dequantize(joined.blocks.numpy(), Q8_0), expected)
    same = QuantizedWeight.join([weight(Q4_K, 8), weight(Q4_K, 3)])
    assert isinstance(same, QuantizedWeight) and same.block_format == Q4_K and same.out_features == 11
    assert QuantizedWeight.join([weight(Q4_K, 8), weight(Q6_K, 3)]) == "stored as Q4_K + Q6_K"
    assert QuantizedWeight.join([weight(Q5_0, 8), torch.zeros(3, 256)]) == "stored as Q5_0 + torch.float32"
    q5_k = QuantizedWeight(torch.zeros(2, 176, dtype=torch.uint8), 13, 256)  # 176 bytes per 256 values
    assert QuantizedWeight.join([q5_k]) == "stored as Q5_K (no kernel for it)"
