"""Llama / Qwen2 decoder over one flattened ragged batch.

Every scheduled token of every request is one row of the input: prefill chunks and decodes
share a forward pass. Logits are computed only at each request's last scheduled token.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.reference import rms_norm_ref, silu_and_mul_ref
from services.common.model_spec import ModelSpec
from services.worker.attention import AttentionBackend, AttentionMetadata, CpuAttentionBackend
from services.worker.kv_cache import KVCache
from services.worker.linear import Linear
from services.worker.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from kernels.cpu_native import CpuKernels


logger = logging.getLogger(__name__)


class MissingWeightError(KeyError):
    pass


@dataclass(frozen=True)
class FusedOps:
    """RMSNorm (optionally fused with the residual add), SiLU-and-multiply and, where the
    backend has it, rotary embedding fused with the KV-cache write: the torch references by
    default, the Triton kernels alongside the Triton attention backend, the C kernels of
    `kernels/cpu` alongside the CPU one (float32)."""

    rms_norm: Callable
    silu_and_mul: Callable
    # (qkv, heads, kv_heads, cos, sin, key_cache, value_cache, slot_mapping) -> queries; None:
    # RotaryEmbedding.apply and the backend's write_kv as separate steps.
    rotary_write_kv: Callable | None = None

    @classmethod
    def for_backend(cls, backend: AttentionBackend, dtype: torch.dtype) -> FusedOps:
        if backend.name == "triton":
            from kernels.fused_ops import rms_norm, silu_and_mul

            return cls(rms_norm, silu_and_mul)
        if isinstance(backend, CpuAttentionBackend) and dtype == torch.float32:
            kernels = backend.kernels
            return cls(kernels.add_rms_norm, kernels.silu_and_mul, kernels.rotary_write_kv)
        return cls(rms_norm_ref, silu_and_mul_ref)


class DecoderLayer:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str,
                 linear: Callable[..., Linear] = Linear):
        def take(name: str) -> torch.Tensor:
            key = prefix + name
            if key not in weights:
                raise MissingWeightError(key)
            return weights[key]

        def optional(name: str) -> torch.Tensor | None:
            return weights.get(prefix + name)

        self.spec = spec
        self.input_norm = take("input_layernorm.weight")
        self.post_attention_norm = take("post_attention_layernorm.weight")
        # q, k and v in one matmul; gate and up in another.
        biases = [optional(f"self_attn.{p}_proj.bias") for p in "qkv"]
        self.qkv_proj = linear(torch.cat([take(f"self_attn.{p}_proj.weight") for p in "qkv"]),
                               torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o_proj = linear(take("self_attn.o_proj.weight"), optional("self_attn.o_proj.bias"))
        self.gate_up_proj = linear(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]))
        self.down_proj = linear(take("mlp.down_proj.weight"))
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5

    def projections(self) -> list[Linear]:
        return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it);
        their sum is the layer's output, formed by the next norm."""
        spec = self.spec
        eps = spec.rms_norm_eps
        if residual is None:
            x, residual = ops.rms_norm(hidden, self.input_norm, eps), hidden
        else:
            x, residual = ops.rms_norm(hidden, self.input_norm, eps, residual)
        qkv = self.qkv_proj(x)
        if ops.rotary_write_kv is not None:
            q = ops.rotary_write_kv(qkv, spec.num_heads, spec.num_kv_heads, *rope, key_cache, value_cache,
                                    meta.slot_mapping)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Queries and keys rotate in one pass.
            qk = RotaryEmbedding.apply(qk.reshape(-1, spec.num_heads + spec.num_kv_heads, spec.head_dim), *rope)
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            v = v.reshape(-1, spec.num_kv_heads, spec.head_dim)
            backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        attn = backend.attend(q, key_cache, value_cache, meta, self.scale)
        attn_out = self.o_proj(attn.reshape(-1, self.q_size))
        x, residual = ops.rms_norm(attn_out, self.post_attention_norm, eps, residual)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))), residual


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int, cpu_kernels: CpuKernels | None = None):
        weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.spec = spec
        self.device = device
        self.dtype = dtype
        if "model.embed_tokens.weight" not in weights:
            raise MissingWeightError("model.embed_tokens.weight")
        self.embed = weights["model.embed_tokens.weight"]
        linear = functools.partial(Linear, small_batch_kernels=cpu_kernels)
        self.layers = [DecoderLayer(spec, weights, f"model.layers.{i}.", linear) for i in range(spec.num_layers)]
        if "model.norm.weight" not in weights:
            raise MissingWeightError("model.norm.weight")
        self.final_norm = weights["model.norm.weight"]
        lm_head = self.embed if spec.tie_word_embeddings else weights.get("lm_head.weight")
        if lm_head is None:
            raise MissingWeightError("lm_head.weight")
        # A fifth of all FLOPs for small models; with tied embeddings the packed copy is extra
        # memory (the lookup needs the plain table) that buys 1.8-2.4x on CPU.
        self.lm_head = linear(lm_head)
        self.rotary = RotaryEmbedding(spec, max_positions, device, dtype)
        linears = [self.lm_head] + [p for layer in self.layers for p in layer.projections()]
        # Packed layers that still hold their plain weight keep it for the small-batch kernel.
        kept = [p.weight for p in linears if p.packed and p.weight is not None and p.weight is not self.embed]
        plain = sum(w.nbytes for w in kept)
        if plain:
            logger.info("small-batch linear kernel: %.0f MiB of plain weights kept beside the packed ones "
                        "(--no-small-batch-linear frees them)", plain / (1 << 20))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, backend: AttentionBackend, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed[input_ids], None
        rope = self.rotary.tables(positions)
        ops = FusedOps.for_backend(backend, self.dtype)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer.forward(hidden, residual, rope, kv_cache.key_caches[i],
                                             kv_cache.value_caches[i], meta, backend, ops)
        last, _ = ops.rms_norm(hidden[logits_indices], self.final_norm, self.spec.rms_norm_eps,
                               residual[logits_indices])
        return self.lm_head(last).float()
