"""Tensor-parallel sharding without a group: the per-rank shapes, the refusals, and the weight
slices (which, put back together, are the checkpoint)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vmesh.services.common.config_flags import env_name, settings_of
from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.config import WorkerConfig
from vmesh.services.worker.tensor_parallel import (
    TensorParallelError,
    join_group,
    kv_head_range,
    parse_rendezvous,
    shard_spec,
    shard_weights,
    vocab_range,
)

SPEC = ModelSpec(architecture="LlamaForCausalLM", vocab_size=301, hidden_size=48, num_layers=1, num_heads=12,
                 num_kv_heads=4, head_dim=4, intermediate_size=24, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True,
                 eos_token_ids=(0,), bos_token_id=None)


def test_shard_spec_divides_heads_and_features():
    local = shard_spec(SPEC, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 6)
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (48, 4, 301)  # the gathered logits are whole
    assert shard_spec(SPEC, 1) == SPEC


def test_shard_spec_replicates_kv_heads_when_ranks_outnumber_them():
    spec = dataclasses.replace(SPEC, num_kv_heads=2)
    assert shard_spec(spec, 4).num_kv_heads == 1
    # Each KV head on two ranks, serving exactly the query heads that read it (3 per rank, 6 per KV head).
    assert [kv_head_range(spec, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize("size, spec_changes, named", [
    (5, {}, "12 attention heads"),
    (6, {}, "4 KV heads"),  # 6 divides 12 query heads but neither divides nor is a multiple of 4 KV heads
    (4, {"num_kv_heads": 3}, "3 KV heads"),
    (2, {"intermediate_size": 25}, "MLP width 25"),
    (0, {}, "at least 1"),
])
def test_shard_spec_refuses_sizes_that_cannot_work(size, spec_changes, named):
    with pytest.raises(TensorParallelError, match=named):
        shard_spec(dataclasses.replace(SPEC, **spec_changes), size)


def test_the_embedded_models_heads_over_three_ranks():
    spec = dataclasses.replace(SPEC, num_heads=9, num_kv_heads=3, hidden_size=36)
    local = shard_spec(spec, 3)
    assert (local.num_heads, local.num_kv_heads) == (3, 1)
    with pytest.raises(TensorParallelError, match="9 attention heads"):
        shard_spec(spec, 2)


def test_vocab_ranges_cover_the_vocabulary_once():
    ranges = [vocab_range(301, r, 4) for r in range(4)]
    assert ranges == [(0, 76), (76, 152), (152, 228), (228, 301)]


def checkpoint(spec: ModelSpec) -> dict[str, torch.Tensor]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "lm_head.weight": (spec.vocab_size,
                                                                                             spec.hidden_size),
        "model.norm.weight": (spec.hidden_size,),
        "model.layers.0.input_layernorm.weight": (spec.hidden_size,),
        "model.layers.0.self_attn.q_proj.weight": (q, spec.hidden_size), "model.layers.0.self_attn.q_proj.bias": (q,),
        "model.layers.0.self_attn.k_proj.weight": (kv, spec.hidden_size), "model.layers.0.self_attn.k_proj.bias": (kv,),
        "model.layers.0.self_attn.v_proj.weight": (kv, spec.hidden_size), "model.layers.0.self_attn.v_proj.bias": (kv,),
        "model.layers.0.self_attn.o_proj.weight": (spec.hidden_size, q),
        "model.layers.0.self_attn.o_proj.bias": (spec.hidden_size,),
        "model.layers.0.mlp.gate_proj.weight": (spec.intermediate_size, spec.hidden_size),
        "model.layers.0.mlp.up_proj.weight": (spec.intermediate_size, spec.hidden_size),
        "model.layers.0.mlp.down_proj.weight": (spec.hidden_size, spec.intermediate_size),
    }
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shards_put_together_are_the_checkpoint(size):
    full = checkpoint(SPEC)
    shards = [shard_weights(full, SPEC, rank, size) for rank in range(size)]
    local = shard_spec(SPEC, size)
    for name, tensor in full.items():
        parts = [shard[name] for shard in shards if name in shard]
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            joined = torch.cat(parts, dim=1)  # row-parallel: split by input columns
        elif name.endswith("o_proj.bias"):
            assert len(parts) == 1, "a row-parallel bias is added once, by rank 0"
            joined = parts[0]
        elif "norm" in name:
            assert all(torch.equal(p, tensor) for p in parts)
            joined = parts[0]
        else:
            joined = torch.cat(parts)
        assert torch.equal(joined, tensor), name
    layer = "model.layers.0."
    q = shards[-1][layer + "self_attn.q_proj.weight"]
    assert q.shape == (local.num_heads * local.head_dim, SPEC.hidden_size)
    assert shards[-1][layer + "self_attn.k_proj.weight"].shape[0] == local.num_kv_heads * local.head_dim
    assert shards[-1][layer + "mlp.down_proj.weight"].shape == (SPEC.hidden_size, local.intermediate_size)


def test_replicated_kv_heads_are_copies():
    spec = dataclasses.replace(SPEC, num_kv_heads=2)
    full = checkpoint(spec)
    shards = [shard_weights(full, spec, rank, 4) for rank in range(4)]
    name = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(shards[0][name], shards[1][name]) and torch.equal(shards[2][name], shards[3][name])
    assert torch.equal(torch.cat([shards[0][name], shards[2][name]]), full[name])


def test_shard_weights_refuses_what_it_cannot_slice():
    full: dict = checkpoint(SPEC)
    full["model.layers.0.mlp.up_proj.weight"] = object()  # a quantized weight kept as GGUF blocks
    with pytest.raises(TensorParallelError, match="up_proj"):
        shard_weights(full, SPEC, 0, 2)


def test_join_group_refuses_before_waiting_for_any_peer():
    assert join_group(WorkerConfig(), SPEC, torch.device("cpu")) is None
    with pytest.raises(TensorParallelError, match="12 attention heads"):
        join_group(WorkerConfig(tensor_parallel_size=5, tensor_parallel_init="127.0.0.1:1"), SPEC, torch.device("cpu"))
    with pytest.raises(TensorParallelError, match="--weights dequantized"):
        join_group(WorkerConfig(tensor_parallel_size=2, tensor_parallel_init="127.0.0.1:1", weights="native"), SPEC,
                   torch.device("cpu"))
    with pytest.raises(TensorParallelError, match="outside a group of 2"):
        join_group(WorkerConfig(tensor_parallel_size=2, tensor_parallel_rank=2, tensor_parallel_init="127.0.0.1:1"),
                   SPEC, torch.device("cpu"))
    with pytest.raises(TensorParallelError, match="--tensor-parallel-init"):
        join_group(WorkerConfig(tensor_parallel_size=2), SPEC, torch.device("cpu"))


def test_rendezvous_address():
    assert parse_rendezvous("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_rendezvous("[::1]:29500") == ("::1", 29500)
    with pytest.raises(TensorParallelError, match="host:port"):
        parse_rendezvous("127.0.0.1")


def test_worker_flags_and_environment():
    flags = {s.flag: env_name(s.flag) for _f, s in settings_of(WorkerConfig, "worker")}
    assert flags["--tensor-parallel-size"] == "VMESH_TENSOR_PARALLEL_SIZE"
    assert flags["--tensor-parallel-rank"] == "VMESH_TENSOR_PARALLEL_RANK"
    assert flags["--tensor-parallel-init"] == "VMESH_TENSOR_PARALLEL_INIT"


def test_a_size_that_leaves_a_rank_no_token_ids_is_refused():
    from vmesh.services.worker.tensor_parallel import TensorParallelError

    spec = dataclasses.replace(SPEC, vocab_size=49, num_heads=8, num_kv_heads=8, intermediate_size=64)
    with pytest.raises(TensorParallelError, match="49 token ids"):
        shard_spec(spec, 8)  # ceil(49 / 8) = 7 ids a rank: rank 7 would start at 49
