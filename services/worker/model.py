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

from vmesh.kernels.reference import rms_norm_ref, silu_and_mul_ref
from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.attention import AttentionBackend, AttentionMetadata, CpuAttentionBackend
from vmesh.services.worker.kv_cache import KVCache
from vmesh.services.worker.linear import Linear
from vmesh.services.worker.quantized_linear import QuantizedLinear, QuantizedWeight, log_placement
from vmesh.services.worker.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels


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
            from vmesh.kernels.fused_ops import rms_norm, silu_and_mul

            return cls(rms_norm, silu_and_mul)
        if isinstance(backend, CpuAttentionBackend) and dtype == torch.float32:
            kernels = backend.kernels
            return cls(kernels.add_rms_norm, kernels.silu_and_mul, kernels.rotary_write_kv)
        return cls(rms_norm_ref, silu_and_mul_ref)


class WeightSource:
    """The checkpoint's tensors, handed out one at a time as owned copies in the model's device
    and dtype. The checkpoint's own tensors may be views of its memory-mapped file; copying each
    as it is taken lets the mapping go once the model is built, and converting one at a time
    keeps the peak at one float32 tensor (plus its packed copy) beyond the model itself.
    With `keep_quantized` (`--weights native`) a linear's GGUF blocks are handed out as they are
    where the kernel reads them; `dequantized` records the linears that were not, and why."""

    def __init__(self, tensors: dict[str, torch.Tensor | QuantizedWeight], device: torch.device, dtype: torch.dtype,
                 keep_quantized: bool = False):
        self.tensors = tensors
        self.device = device
        self.dtype = dtype
        self.keep_quantized = keep_quantized
        self.dequantized: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise MissingWeightError(name)
        tensor = self.tensors[name]
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        return tensor.to(device=self.device, dtype=self.dtype, copy=True)

    def take_linear(self, *names: str) -> torch.Tensor | QuantizedWeight:
        """A linear's weight: these tensors stacked by rows, quantized where kept so."""
        for name in names:
            if name not in self.tensors:
                raise MissingWeightError(name)
        if self.keep_quantized:
            joined = QuantizedWeight.join([self.tensors[name] for name in names])
            if isinstance(joined, QuantizedWeight):
                return joined
            self.dequantized[" + ".join(names)] = joined
        taken = [self.take(name) for name in names]
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.tensors else None


class DecoderLayer:
    def __init__(self, spec: ModelSpec, weights: WeightSource, prefix: str,
                 linear: Callable[..., Linear | QuantizedLinear] = Linear):
        def take(name: str) -> torch.Tensor:
            return weights.take(prefix + name)

        def weight(*names: str) -> torch.Tensor | QuantizedWeight:
            return weights.take_linear(*(f"{prefix}{name}.weight" for name in names))

        def optional(name: str) -> torch.Tensor | None:
            return weights.optional(prefix + name)

        self.spec = spec
        self.input_norm = take("input_layernorm.weight")
        self.post_attention_norm = take("post_attention_layernorm.weight")
        # q, k and v in one matmul; gate and up in another.
        biases = [b for p in "qkv" if (b := optional(f"self_attn.{p}_proj.bias")) is not None]
        self.qkv_proj = linear(weight(*(f"self_attn.{p}_proj" for p in "qkv")),
                               torch.cat(biases) if len(biases) == 3 else None)
        self.o_proj = linear(weight("self_attn.o_proj"), optional("self_attn.o_proj.bias"))
        self.gate_up_proj = linear(weight("mlp.gate_proj", "mlp.up_proj"))
        self.down_proj = linear(weight("mlp.down_proj"))
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5

    def projections(self) -> list[Linear | QuantizedLinear]:
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
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor | QuantizedWeight], device: torch.device,
                 dtype: torch.dtype, max_positions: int, cpu_kernels: CpuKernels | None = None,
                 quantized_kernels: CpuKernels | None = None):
        """quantized_kernels: `--weights native`, linears kept as GGUF blocks where the kernel reads them."""
        source = WeightSource(weights, device, dtype, keep_quantized=quantized_kernels is not None)
        self.spec = spec
        self.device = device
        self.dtype = dtype
        embed_name = "model.embed_tokens.weight"
        embed = source.take_linear(embed_name) if spec.tie_word_embeddings else source.take(embed_name)
        plain_linear = functools.partial(Linear, small_batch_kernels=cpu_kernels)

        def linear(weight: torch.Tensor | QuantizedWeight,
                   bias: torch.Tensor | None = None) -> Linear | QuantizedLinear:
            if isinstance(weight, QuantizedWeight):
                assert quantized_kernels is not None, "weights stay quantized only with the kernels that read them"
                return QuantizedLinear(weight, bias, quantized_kernels)
            return plain_linear(weight, bias)

        self.layers = [DecoderLayer(spec, source, f"model.layers.{i}.", linear) for i in range(spec.num_layers)]
        self.final_norm = source.take("model.norm.weight")
        # A fifth of all FLOPs for small models, so it is packed like every linear. A tied
        # head also serves the embedding lookups when its rows can be read back, so that the
        # table is held once; otherwise the plain table stays for them.
        self.lm_head = linear(embed if spec.tie_word_embeddings else source.take_linear("lm_head.weight"))
        lookups_from_head = spec.tie_word_embeddings and self.lm_head.weight is None and self.lm_head.rows_readable
        self.embed: torch.Tensor | None = None
        if not lookups_from_head:
            assert isinstance(embed, torch.Tensor), "a quantized table serves the lookups from the head"
            self.embed = embed
        self.rotary = RotaryEmbedding(spec, max_positions, device, dtype)
        if source.keep_quantized:
            log_placement(self.linears(), source.dequantized)
        logger.info("weights: %s", ", ".join(f"{name} {size / (1 << 20):.1f} MiB"
                                             for name, size in self.held_bytes().items()))

    def linears(self) -> list[Linear | QuantizedLinear]:
        return [self.lm_head] + [p for layer in self.layers for p in layer.projections()]

    def held_bytes(self) -> dict[str, int]:
        """Bytes of weights held per representation: oneDNN's packed linears, plain linear weights
        (a small-batch copy, or the only one where nothing is packed), the plain embedding table
        (0 when the tied LM head's copy serves the lookups), and the rest (norms, biases)."""
        embedding = self.embed.nbytes if self.embed is not None else 0
        held = {"packed oneDNN": 0, "plain linear": 0, "quantized GGUF": 0, "embedding": embedding,
                "norms and biases": 0}
        kinds = {"packed": "packed oneDNN", "plain": "plain linear", "quantized": "quantized GGUF"}
        for layer in self.linears():
            for representation, size in layer.held_bytes().items():
                if representation == "plain" and layer.weight is self.embed:
                    continue  # the embedding table, counted once
                held[kinds[representation]] += size
            held["norms and biases"] += layer.bias.nbytes if layer.bias is not None else 0
        norms = [self.final_norm] + [n for layer in self.layers for n in (layer.input_norm, layer.post_attention_norm)]
        held["norms and biases"] += sum(n.nbytes for n in norms)
        return held

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] if self.embed is not None else self.lm_head.weight_rows(input_ids)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, backend: AttentionBackend, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.tables(positions)
        ops = FusedOps.for_backend(backend, self.dtype)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer.forward(hidden, residual, rope, kv_cache.key_caches[i],
                                             kv_cache.value_caches[i], meta, backend, ops)
        assert residual is not None, "the model has at least one layer"
        last, _ = ops.rms_norm(hidden[logits_indices], self.final_norm, self.spec.rms_norm_eps,
                               residual[logits_indices])
        return self.lm_head(last).float()
