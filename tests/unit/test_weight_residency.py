"""Each weight is held once, in the layout its kernels read: no plain
float32 copy beside a packed one, the tied LM head sharing the embedding table, and the
checkpoint's memory-mapped file let go once the model is built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import save_tiny_llama, save_tiny_qwen2
from vmesh.services.worker.linear import Linear, PackedLayout, onednn_packing_usable, packed_layout
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


def mapped_files() -> set[Path]:
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.add(Path(fields[5]))
    return paths


def small_batch_reads_packed(shape: tuple[int, int]) -> bool:
    """Whether oneDNN packs a float32 weight of this shape in the layout the small-batch kernel
    reads (OI16i64o on AVX-512); elsewhere the layer keeps a plain copy for it, by design."""
    weight = torch.randn(*shape)
    if not onednn_packing_usable(weight):
        return False
    return packed_layout(weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)) is not None


def load(model_dir: Path, small_batch_linear: bool = True) -> ModelRunner:
    return ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_num_seqs=8,
                                         small_batch_linear=small_batch_linear))


pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps (Linux)")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("small_batch_linear", [True, False])
def test_each_weight_is_held_once(tmp_path, caplog, kind, small_batch_linear):
    reference = save_tiny_qwen2(tmp_path) if kind == "qwen2" else save_tiny_llama(tmp_path)
    checkpoint = tmp_path / "model.safetensors"
    with caplog.at_level(logging.INFO, logger="vmesh.services.worker.model"):
        runner = load(tmp_path, small_batch_linear)
    model = runner.model
    assert checkpoint.resolve() not in mapped_files(), "the checkpoint stays mapped after load"

    linears: list[Linear] = model.linears()
    packing = onednn_packing_usable(torch.empty(1, 1))
    assert all(layer.packed == packing for layer in linears)
    small_batch_kernel = small_batch_linear and runner.backend.name == "cpu"  # a C compiler exists
    for layer in linears:
        if not layer.packed or (small_batch_kernel and not small_batch_reads_packed(
                (layer.out_features, layer.in_features))):
            assert layer.weight is not None  # the plain weight is the only one a kernel reads
        else:
            assert layer.weight is None, f"a plain copy beside the packed {layer.out_features}x{layer.in_features}"

    parameters = dict(reference.named_parameters())
    table = parameters["model.embed_tokens.weight"]
    tied = reference.config.tie_word_embeddings
    if tied and model.lm_head.weight is None:  # the packed head answers the lookups: no table
        assert model.embed is None
    else:
        assert model.embed is not None and (model.lm_head.weight is model.embed) == tied
    ids = torch.tensor([0, 1, 63, 64, 65, table.shape[0] - 1, 7, 7])
    assert torch.equal(model.embed_tokens(ids), table.detach()[ids])
    held = model.held_bytes()
    linear_bytes = sum(p.nbytes for name, p in parameters.items()
                       if p.dim() == 2 and "embed_tokens" not in name) + (table.nbytes if tied else 0)
    if packing:
        # oneDNN pads each dimension to its blocks (64 outputs, 16 inputs): at most that much more.
        assert linear_bytes <= held["packed oneDNN"] <= 2 * linear_bytes
        expected_plain = sum(layer.weight.nbytes for layer in linears
                             if layer.weight is not None and layer.weight is not model.embed)
        assert held["plain linear"] == expected_plain
        if small_batch_kernel and all(small_batch_reads_packed((layer.out_features, layer.in_features))
                                      for layer in linears):
            assert held["plain linear"] == 0
    assert held["embedding"] == (0 if model.embed is None else table.nbytes)
    every_weight = sum(p.nbytes for p in parameters.values())
    held_plain = held["plain linear"] + held["embedding"] + held["norms and biases"]
    assert held_plain + (held["packed oneDNN"] if packing else 0) < 2 * every_weight
    assert "weights: packed oneDNN" in caplog.text and "embedding" in caplog.text


def test_packed_layout_check_refuses_a_weight_it_does_not_hold():
    weight = torch.randn(130, 40)
    if not onednn_packing_usable(weight):
        pytest.skip("no oneDNN packing in this torch build")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    if packed_layout(weight, packed) is None:
        pytest.skip("oneDNN packs another layout on this CPU; the small-batch kernel keeps a plain copy")
    assert packed_layout(weight, packed) == PackedLayout(48, 64)  # 40 inputs padded to oneDNN's 16-wide blocks
    other = weight.clone()
    other[129, 39] += 1.0  # the last output's last input: in the padded last block
    assert packed_layout(other, packed) is None
    assert packed_layout(weight.T.contiguous(), packed) is None


@pytest.mark.parametrize("kind", ["llama", "qwen2", "embedded"])
def test_spec_from_plain_config_json_matches_transformers(tmp_path, kind, embedded_model_dir):
    """The worker reads a complete config.json without transformers (whose import alone costs it
    ~75 MiB); what it reads must be what transformers' config classes would give."""
    from vmesh.services.common.model_loading import load_hf_config, load_model_spec, plain_config
    from vmesh.services.common.model_spec import ModelSpec

    model_dir = embedded_model_dir if kind == "embedded" else tmp_path
    if kind == "qwen2":
        save_tiny_qwen2(tmp_path)
    elif kind == "llama":
        save_tiny_llama(tmp_path)
    assert plain_config(model_dir) is not None
    assert load_model_spec(model_dir) == ModelSpec.from_hf_config(load_hf_config(model_dir))


def test_plain_config_defers_to_transformers_when_a_key_is_left_to_defaults(tmp_path):
    import json

    from vmesh.services.common.model_loading import plain_config

    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plain_config(tmp_path) is None
    config["rms_norm_eps"] = 1e-5
    config["rope_scaling"], config["rope_parameters"] = {"type": "linear", "factor": 2.0}, None
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plain_config(tmp_path) is None
