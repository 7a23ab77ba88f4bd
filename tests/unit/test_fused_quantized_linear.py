"""vmesh/kernels/cpu/fused_linear.c: a quantized linear with the RMSNorm (and residual add) or the
SiLU-and-multiply before it in one call gives, bit for bit, what the two calls give, on both the
integer and the float32 kernel; and the decoder takes that path only where the C ops run."""

from __future__ import annotations

import pytest
import torch

from tests.support.gguf_blocks import FORMATS, Q4_1
from tests.unit.test_quantized_linear import layer, shapes_of
from vmesh.services.worker.model import FusedOps
from vmesh.services.worker.quantized_linear import DOT_ENV


@pytest.fixture(params=["int8", "float"])
def dot(request, kernels, monkeypatch):
    if request.param == "int8" and not kernels.integer_dot:
        pytest.skip("this CPU has no AVX-512 VNNI")
    monkeypatch.setenv(DOT_ENV, request.param)
    return request.param


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_then_product_is_the_two_calls(kernels, dot, name, rows, with_residual):
    in_features = shapes_of(name, [(0, 96)], [(0, 512)])[0][1]
    linear, _, _ = layer(FORMATS[name], 37, in_features, kernels, bias=True, seed=rows)
    x, norm_weight = torch.randn(rows, in_features), torch.rand(in_features) + 0.5
    residual = torch.randn(rows, in_features) if with_residual else None
    separate_residual = residual.clone() if residual is not None else None
    if separate_residual is None:
        normed = kernels.add_rms_norm(x, norm_weight, 1e-6)
        separate_stream = x
    else:
        normed, separate_stream = kernels.add_rms_norm(x, norm_weight, 1e-6, separate_residual)
    separate = linear(normed)
    fused, stream = linear.after_rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(fused, separate)
    assert torch.equal(stream, separate_stream)
    assert stream is (x if residual is None else residual), "the stream is updated in place, as add_rms_norm's"


@pytest.mark.parametrize("rows", [1, 6, 7])
def test_silu_then_product_is_the_two_calls(kernels, dot, rows):
    linear, _, _ = layer(Q4_1, 203, 1536, kernels, bias=False, seed=rows)
    gate_up = torch.randn(rows, 2 * 1536) * 3
    assert torch.equal(linear.after_silu_and_mul(gate_up), linear(kernels.silu_and_mul(gate_up)))


def test_fused_calls_check_their_inputs(kernels, dot):
    linear, _, _ = layer(Q4_1, 8, 96, kernels, bias=False)
    with pytest.raises(ValueError):
        linear.after_rms_norm(torch.randn(2, 96), torch.ones(64), 1e-6)
    with pytest.raises(ValueError):
        linear.after_rms_norm(torch.randn(2, 96), torch.ones(96), 1e-6, torch.randn(3, 96))
    with pytest.raises(ValueError):
        linear.after_silu_and_mul(torch.randn(2, 96))


def test_only_the_c_float32_ops_take_ops_into_the_linear(kernels):
    from vmesh.kernels.reference import rms_norm_ref, silu_and_mul_ref

    assert not FusedOps(rms_norm_ref, silu_and_mul_ref).into_quantized_linear
