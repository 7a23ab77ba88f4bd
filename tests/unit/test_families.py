"""Layer plans read from transformers' config classes, the refusals of what no family runs (each
naming its config field), expert weights split across tensor-parallel ranks, and the mixture of
experts computing each expert once per step over the tokens routed to it."""

from __future__ import annotations

import pytest
import torch

from vmesh.services.common.families.plan import MlpPlan
from vmesh.services.common.model_spec import ModelSpec, UnsupportedModelError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)


def test_qwen2_sliding_layers_follow_max_window_layers():
    from transformers import Qwen2Config

    spec = ModelSpec.from_hf_config(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16,
                                                max_window_layers=1))
    assert [layer.attention.window for layer in spec.layers] == [None, 16, 16]
    assert all(layer.attention.qkv_bias and not layer.attention.qk_norm for layer in spec.layers)


def test_qwen2_as_raw_json_reads_the_same_windows():
    """The worker's plain config.json path (no transformers class) derives the same layer windows."""
    from types import SimpleNamespace

    raw = SimpleNamespace(**SMALL, model_type="qwen2", rms_norm_eps=1e-6, max_position_embeddings=64,
                          eos_token_id=None, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert [layer.attention.window for layer in ModelSpec.from_hf_config(raw).layers] == [None, None, 16]


def test_mistral_windows_every_layer_and_qwen3_moe_keeps_dense_layers():
    from transformers import MistralConfig, Qwen3MoeConfig

    mistral = ModelSpec.from_hf_config(MistralConfig(**SMALL, sliding_window=7))
    assert {layer.attention.window for layer in mistral.layers} == {7}
    assert ModelSpec.from_hf_config(MistralConfig(**SMALL, sliding_window=None)).layers[0].attention.window is None
    moe = ModelSpec.from_hf_config(Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=8, mlp_only_layers=[1]))
    assert [layer.mlp.num_experts for layer in moe.layers] == [4, 0, 4]
    assert [layer.mlp.intermediate_size for layer in moe.layers] == [8, 48, 8]
    assert all(layer.attention.qk_norm for layer in moe.layers)


@pytest.mark.parametrize(("config", "field"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
])
def test_refusals_name_the_config_field(config, field):
    from transformers import LlamaConfig

    base = LlamaConfig(**SMALL)
    for key, value in config.items():
        setattr(base, key, value)
    with pytest.raises(UnsupportedModelError, match=field.replace(".", r"\.")):
        ModelSpec.from_hf_config(base)


def test_stacked_and_per_expert_weights_split_across_ranks():
    """Each rank holds its slice of every expert's gate and up rows and down columns; the slices
    put back together are the experts."""
    from transformers import Qwen3MoeConfig

    from vmesh.services.worker.tensor_parallel import shard_spec, shard_weights

    spec = ModelSpec.from_hf_config(Qwen3MoeConfig(**{**SMALL, "num_hidden_layers": 1}, num_experts=3,
                                                   num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8))
    gate_up, down = torch.randn(3, 16, 32), torch.randn(3, 32, 8)
    per_expert = {"model.layers.0.mlp.experts.1.gate_proj.weight": gate_up[1, :8],
                  "model.layers.0.mlp.experts.1.down_proj.weight": down[1]}
    stacked = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down,
               "model.layers.0.mlp.gate.weight": torch.randn(3, 32)}
    shards = [shard_weights({**stacked, **per_expert}, spec, rank, 2) for rank in range(2)]
    assert shard_spec(spec, 2).layers[0].mlp.intermediate_size == 4
    gates = torch.cat([s["model.layers.0.mlp.experts.gate_up_proj"][:, :4] for s in shards], dim=1)
    ups = torch.cat([s["model.layers.0.mlp.experts.gate_up_proj"][:, 4:] for s in shards], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), gate_up)
    assert torch.equal(torch.cat([s["model.layers.0.mlp.experts.down_proj"] for s in shards], dim=2), down)
    assert torch.equal(torch.cat([s["model.layers.0.mlp.experts.1.gate_proj.weight"] for s in shards]), gate_up[1, :8])
    assert torch.equal(torch.cat([s["model.layers.0.mlp.experts.1.down_proj.weight"] for s in shards], dim=1), down[1])
    assert all(torch.equal(s["model.layers.0.mlp.gate.weight"], stacked["model.layers.0.mlp.gate.weight"])
               for s in shards)  # the router: whole on every rank


def test_mixture_of_experts_calls_each_expert_once_over_its_tokens(monkeypatch):
    from vmesh.kernels.reference import rms_norm_ref, silu_and_mul_ref
    from vmesh.services.common.families.plan import WeightNames
    from vmesh.services.worker.linear import Linear
    from vmesh.services.worker.mlp import DenseMlp, MixtureOfExperts
    from vmesh.services.worker.model import FusedOps, WeightSource

    torch.manual_seed(0)
    experts, hidden, inter, tokens = 5, 16, 8, 37
    tensors = {"mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden),
               "mlp.experts.down_proj": torch.randn(experts, hidden, inter),
               "mlp.gate.weight": torch.randn(experts, hidden)}
    plan = MlpPlan(inter, num_experts=experts, experts_per_token=2, normalize_routing=True)
    moe = MixtureOfExperts.load(plan, WeightSource(tensors, torch.device("cpu"), torch.float32), "", WeightNames(),
                                Linear)
    ops = FusedOps(rms_norm_ref, silu_and_mul_ref)
    rows_seen: list[int] = []
    call = DenseMlp.__call__
    monkeypatch.setattr(DenseMlp, "__call__", lambda self, x, o: rows_seen.append(x.shape[0]) or call(self, x, o))
    x = torch.randn(tokens, hidden)
    got = moe(x, ops)
    assert len(rows_seen) <= experts and sum(rows_seen) == tokens * 2
    weights, chosen = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    want = torch.zeros_like(x)
    for t in range(tokens):  # the definition, token by token
        for w, e in zip(weights[t], chosen[t]):
            gate, up = (tensors["mlp.experts.gate_up_proj"][e] @ x[t]).chunk(2)
            want[t] += w * (tensors["mlp.experts.down_proj"][e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
