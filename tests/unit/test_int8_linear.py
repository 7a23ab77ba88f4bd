"""`--weights int8`: vmesh/kernels/cpu/int8_linear.c against a float64 reference of what it computes (the
int8 weight codes times their per-row scales, times the activations rounded to 16 bits per row below
BLOCK_PATH_MIN_ROWS rows, to 8 bits per block of 64 from it), written here from that definition; the
load-time quantization and packing; and the mode on a tiny model, in float32 and mixed bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.plan_driver import forced_agreement, greedy_ragged
from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama
from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.worker.int8_linear import BLOCK_PATH_MIN_ROWS, Int8Linear, pack_for_blocks, quantize_per_row
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


def per_block_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Codes of max |x| / 127 per block of `block` inputs, times that scale; in numpy's float32, whose
    division is IEEE's, as the kernel's is (torch's 127 / top can differ by an ulp and move a tie)."""
    blocks = x.numpy().reshape(x.shape[0], -1, block)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0))
    codes = np.rint(blocks * inverse)
    return torch.from_numpy(codes * (top / np.float32(127))).reshape(x.shape)


def rounded_like_the_kernel(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    if layer.blocks is not None and x.shape[0] >= BLOCK_PATH_MIN_ROWS:
        return per_block_int8(x, layer.kernels.int8_block_inputs)
    return per_row_int16(x)


def test_quantize_per_row():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.02]])
    codes, scale = quantize_per_row(weight)
    assert codes.dtype == torch.int8 and codes.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -1]]
    torch.testing.assert_close(scale, torch.tensor([1 / 127, 0.0, 3 / 127]))


# Rows: both paths, the block path's row tails of 1-3 and a second panel of 256 rows with a tail;
# features: a partial last vector in tiles of 1, 2 and 3 vectors of 16.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 10, 16, 67, 256, 259])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 4), (7, 100), (203, 576), (66, 1536), (40, 128)])
def test_kernel_matches_int8_reference(int8_kernels, rows, out_features, in_features):
    torch.manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features) if rows % 2 else None
    layer = Int8Linear(weight, bias, int8_kernels)
    x = torch.randn(rows, in_features) * torch.linspace(0.1, 3, in_features)
    x[0] = 0  # a row of zeros: scale 0
    want = (rounded_like_the_kernel(layer, x).double() @ layer.dequantized().double().T
            + (bias.double() if bias is not None else 0))
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


def test_the_block_correction_at_the_largest_codes(int8_kernels):
    """Every activation and weight code at 127 over 8,448 inputs: each block's sums carry the
    offset's 128 sum(q) at its largest, which the per-row correction must take out exactly enough."""
    layer = Int8Linear(torch.ones(3, 8448), None, int8_kernels)
    got = layer(torch.ones(BLOCK_PATH_MIN_ROWS, 8448))
    torch.testing.assert_close(got, torch.full((BLOCK_PATH_MIN_ROWS, 3), 8448.0))


def test_a_non_finite_input_gives_nan_rows(int8_kernels):
    """A NaN or infinity in a row makes that row's outputs NaN on the block path (a float product's
    would be NaN or infinite), never a finite number; the other rows are untouched."""
    layer = Int8Linear(torch.randn(20, 128), None, int8_kernels)
    x = torch.randn(BLOCK_PATH_MIN_ROWS, 128)
    clean = layer(x)
    x[2, 70], x[5, 3] = float("nan"), float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        got = layer(x.to(dtype)).float()
        assert got[2].isnan().all() and got[5].isnan().all()
        rest = [r for r in range(BLOCK_PATH_MIN_ROWS) if r not in (2, 5)]
        if dtype == torch.float32:
            torch.testing.assert_close(got[rest], clean[rest])
        else:
            assert got[rest].isfinite().all()


def test_packing_for_the_block_path():
    codes = torch.arange(-60, 60, dtype=torch.int8).view(3, 40)[:, :32].contiguous()  # 3 features x 32 inputs
    packed = pack_for_blocks(codes)
    assert packed.shape == (1, 8, 16, 4) and packed.dtype == torch.uint8
    # Feature f's inputs 4g .. 4g + 3 at [0, g, f], offset by 128; features 3-15 pad with code 0.
    assert packed[0, 2, 1].tolist() == [int(c) + 128 for c in codes[1, 8:12]]
    assert (packed[0, :, 3:] == 128).all()


@pytest.mark.parametrize("rows", [BLOCK_PATH_MIN_ROWS, 33, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_in_and_out(int8_kernels, rows, bias):
    """The mixed model's layers: float32 or bfloat16 in, bfloat16 out, which is the float32 result
    rounded to nearest even (torch's .to(bfloat16)), bit for bit."""
    torch.manual_seed(rows)
    weight = torch.randn(100, 576).bfloat16()
    layer = Int8Linear(weight, torch.randn(100) if bias else None, int8_kernels)
    assert layer.out_dtype == torch.bfloat16 and layer.blocks is not None
    x = torch.randn(rows, 576)
    for given in (x.bfloat16(), x.bfloat16().float(), x):
        got = layer(given)
        as_float32 = int8_kernels.int8_block_linear(given.contiguous(), layer.blocks, layer.scale, layer.bias,
                                                    torch.float32)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, as_float32.to(torch.bfloat16))
        want = rounded_like_the_kernel(layer, given.float()).double() @ layer.dequantized().double().T
        want += layer.bias.double() if bias else 0
        torch.testing.assert_close(as_float32.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # Below the block path the 16-bit path's float32 result is rounded to bfloat16 the same way.
    few = layer(x[:3].bfloat16())
    assert few.dtype == torch.bfloat16
    assert torch.equal(few, int8_kernels.int8_linear(x[:3].bfloat16().float(), layer.codes, layer.scale,
                                                     layer.row_sums, layer.bias).to(torch.bfloat16))


@pytest.mark.parametrize("out_features", [16, 100, 2000])
def test_the_block_kernel_gives_the_same_bits_on_any_thread_count(int8_kernels, out_features):
    """Each thread takes a run of weight tiles of its own (and fetches its next one ahead): from
    one thread to more threads than tiles, over two panels of rows, every output is computed once
    and the same."""
    torch.manual_seed(out_features)
    layer = Int8Linear(torch.randn(out_features, 192), None, int8_kernels)
    x = torch.randn(300, 192)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 7):
            torch.set_num_threads(count)
            results.append(int8_kernels.int8_block_linear(x, layer.blocks, layer.scale, None, torch.float32))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])
    want = rounded_like_the_kernel(layer, x).double() @ layer.dequantized().double().T
    torch.testing.assert_close(results[0].double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_block_kernel_refuses_what_does_not_describe_one_layer(int8_kernels):
    layer = Int8Linear(torch.randn(40, 128), torch.randn(40), int8_kernels)
    x = torch.randn(8, 128)
    for bad_bias in (torch.randn(39), torch.randn(40).double(), torch.randn(80)[::2]):
        with pytest.raises(ValueError):
            int8_kernels.int8_block_linear(x, layer.blocks, layer.scale, bad_bias, torch.float32)
    with pytest.raises(ValueError, match="do not describe one layer"):
        int8_kernels.int8_block_linear(x, layer.blocks, layer.scale[:16], None, torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        int8_kernels.int8_block_linear(torch.randn(8, 64), layer.blocks, layer.scale, None, torch.float32)
    with pytest.raises(ValueError, match="do not describe one layer"):  # a width that is not whole blocks
        narrow = pack_for_blocks(torch.zeros(40, 96, dtype=torch.int8))
        int8_kernels.int8_block_linear(torch.randn(8, 96), narrow, layer.scale, None, torch.float32)


def test_leading_dimensions_rows_and_memory(int8_kernels):
    weight = torch.randn(40, 64)
    layer = Int8Linear(weight, None, int8_kernels)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), layer(x.reshape(6, 64)).view(2, 3, 40))
    ids = torch.tensor([39, 0, 5])
    torch.testing.assert_close(layer.weight_rows(ids), layer.dequantized()[ids])
    # codes, scales, row sums, and the block path's copy: 3 vectors of 16 features x 64 inputs
    assert layer.held_bytes() == {"int8": 40 * 64 + 40 * 4 + 40 * 4 + 3 * 16 * 64} and layer.weight is None


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


def test_int8_mode_in_the_mixed_bfloat16_model(int8_kernels, tmp_path):
    """`--weights int8 --dtype bfloat16`: int8 linears with bfloat16 in and out beside the bfloat16
    KV cache, on a tiny model 128 wide so that every linear has the block path. Over ragged steps
    (prefill chunks of 16 on the block path beside decodes on the 16-bit path), the next token under
    teacher forcing against the mixed model with bfloat16 weights, asserted >= 0.7: these random
    weights leave many logits near-tied (bfloat16 against float32 agrees on ~0.93-0.96 of them in
    test_bf16_path), and a wrong kernel agrees on almost none. The embedded model's perplexity cost
    is in benchmarks/README.md."""
    save_tiny_llama(tmp_path, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)

    def load(weights: str) -> ModelRunner:
        return ModelRunner.load(WorkerConfig(model=str(tmp_path), weights=weights, dtype="bfloat16",
                                             kv_cache_memory=16 << 20, max_num_seqs=256))

    runner = load("int8")
    model = runner.model
    assert all(isinstance(layer, Int8Linear) and layer.out_dtype == torch.bfloat16 and layer.blocks is not None
               for layer in model.linears())
    assert runner.kv_cache.key_caches[0].dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (5, 17, 40, 1, 33)]
    want = greedy_ragged(load("dequantized"), prompts, 16)
    agreement = forced_agreement(runner, prompts, want)
    assert agreement >= 0.7, f"next-token agreement {agreement:.3f}"


def test_refused_off_the_cpu_float32_and_bfloat16_paths(tiny_dir):
    with pytest.raises(ModelLoadError, match="CPU in float32 or bfloat16"):
        ModelRunner.load(WorkerConfig(model=str(tiny_dir), weights="int8", dtype="float16", kv_cache_memory=4 << 20))


def test_refused_without_vnni(kernels, tiny_dir, monkeypatch):
    monkeypatch.setattr(kernels, "integer_dot", False)
    monkeypatch.setattr("vmesh.services.worker.quantized_linear.load_cpu_kernels", lambda cache_dir: kernels)
    with pytest.raises(ModelLoadError, match="needs AVX-512 VNNI"):
        ModelRunner.load(WorkerConfig(model=str(tiny_dir), weights="int8", kv_cache_memory=4 << 20))
