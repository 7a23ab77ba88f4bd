"""Loading fails at once, naming the problem."""

from __future__ import annotations

import json

import pytest

from tests.support.tiny_models import save_tiny_llama
from vmesh.services.common.model_loading import ModelLoadError, resolve_model_dir
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


def load(path) -> ModelRunner:
    return ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=1 << 20))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        load(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = config["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="yarn"):
        load(tmp_path)


def test_missing_path_config_and_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path))
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: no \*\.safetensors"):
        load(tmp_path)


def test_missing_shard(tmp_path):
    save_tiny_llama(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing file: .*{shard.name}"):
        load(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
    save_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07garbage" * 100)
    with pytest.raises(ModelLoadError, match="corrupt checkpoint file .*model.safetensors"):
        load(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load(tmp_path)


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        resolve_model_dir(str(f))


def test_embedded_model_is_cached(embedded_model_dir):
    # The second resolution reads the cache: same directory, complete, no reconversion.
    assert resolve_model_dir(None) == embedded_model_dir
    assert (embedded_model_dir / "model.safetensors").is_file()
    assert (embedded_model_dir / "tokenizer.json").is_file()
    assert json.loads((embedded_model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    from vmesh.services.common.model_loading import default_cache_dir

    monkeypatch.setenv("VMESH_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"


def test_services_sharing_a_cache_convert_a_model_once(tmp_path, monkeypatch):
    """Several services start together on one cache (a compose volume): one converts, the
    others wait and read its result, none replaces it under another."""
    import threading
    import time as time_module

    from vmesh.services.common import model_loading

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-not-really")
    calls = []

    def slow_convert(path, target):
        calls.append(target)
        time_module.sleep(0.3)
        target.mkdir(parents=True)
        (target / model_loading._COMPLETE_MARKER).write_text("{}")
        return target

    monkeypatch.setattr(model_loading, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_loading.convert_gguf(gguf, tmp_path / "c")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
