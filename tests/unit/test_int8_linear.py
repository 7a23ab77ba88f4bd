"""`--weights int8`: vmesh/kernels/cpu/int8_linear.c against a float64 reference of what it computes (the
int8 weight codes times their per-row scales, times the activations rounded to 16 bits per row),
written here from that definition; the load-time quantization; and the mode on a tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama
from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.worker.int8_linear import Int8Linear, quantize_per_row
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


@pytest.fixture(scope="module")
def int8_kernels(kernels):
    if not kernels.integer_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: --weights int8 refuses to load (test_refused_without_vnni)")
    return kernels


def per_row_int16(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=1, keepdim=True) / 32767
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (x * inverse).round() * scale


def test_quantize_per_row():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.02]])
    codes, scale = quantize_per_row(weight)
    assert codes.dtype == torch.int8 and codes.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -1]]
    torch.testing.assert_close(scale, torch.tensor([1 / 127, 0.0, 3 / 127]))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 67, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 4), (7, 100), (203, 576), (66, 1536)])
def test_kernel_matches_int8_reference(int8_kernels, rows, out_features, in_features):
    torch.manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features) if rows % 2 else None
    layer = Int8Linear(weight, bias, int8_kernels)
    x = torch.randn(rows, in_features) * torch.linspace(0.1, 3, in_features)
    x[0] = 0  # a row of zeros: scale 0
    want = per_row_int16(x).double() @ layer.dequantized().double().T + (bias.double() if bias is not None else 0)
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * max(float(want.abs().max()), 1.0))
    # ... and about 1 % of the output's scale from the float32 product.
    exact = x.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    assert float((got.double() - exact).abs().max()) < 0.03 * max(float(exact.abs().max()), 1e-6)


def test_sums_of_a_wide_input_are_exact(int8_kernels):
    """Every product at its largest (32,767 x 127) over 8,448 inputs: 3.5e10 in all, far past
    int32's range, which only the split into bytes and int64 sums keep exact."""
    layer = Int8Linear(torch.ones(3, 8448), None, int8_kernels)
    got = layer(torch.ones(2, 8448))
    torch.testing.assert_close(got, torch.full((2, 3), 8448.0))


def test_leading_dimensions_rows_and_memory(int8_kernels):
    weight = torch.randn(40, 64)
    layer = Int8Linear(weight, None, int8_kernels)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), layer(x.reshape(6, 64)).view(2, 3, 40))
    ids = torch.tensor([39, 0, 5])
    torch.testing.assert_close(layer.weight_rows(ids), layer.dequantized()[ids])
    assert layer.held_bytes() == {"int8": 40 * 64 + 40 * 4 + 40 * 4} and layer.weight is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


def test_int8_mode_on_a_tiny_model(int8_kernels, tiny_dir):
    """Every linear, the tied head included, is int8; the logits stay within a few percent of float32's."""
    runners = {mode: ModelRunner.load(WorkerConfig(model=str(tiny_dir), weights=mode, kv_cache_memory=4 << 20))
               for mode in ("dequantized", "int8")}
    model = runners["int8"].model
    assert all(isinstance(layer, Int8Linear) for layer in model.linears()) and model.embed is None
    held = model.held_bytes()
    assert held["int8"] > 0 and held["packed oneDNN"] == held["plain linear"] == held["embedding"] == 0
    ids = torch.arange(0, TINY_VOCAB, 7)
    logits = {}
    for mode, runner in runners.items():
        hidden = runner.model.embed_tokens(ids)
        logits[mode] = runner.model.lm_head(hidden)
    scale = float(logits["dequantized"].abs().max())
    assert float((logits["int8"] - logits["dequantized"]).abs().max()) < 0.05 * scale


def test_refused_off_the_cpu_float32_path(tiny_dir):
    with pytest.raises(ModelLoadError, match="CPU in float32"):
        ModelRunner.load(WorkerConfig(model=str(tiny_dir), weights="int8", dtype="bfloat16", kv_cache_memory=4 << 20))


def test_refused_without_vnni(kernels, tiny_dir, monkeypatch):
    monkeypatch.setattr(kernels, "integer_dot", False)
    monkeypatch.setattr("vmesh.services.worker.quantized_linear.load_cpu_kernels", lambda cache_dir: kernels)
    with pytest.raises(ModelLoadError, match="needs AVX-512 VNNI"):
        ModelRunner.load(WorkerConfig(model=str(tiny_dir), weights="int8", kv_cache_memory=4 << 20))
