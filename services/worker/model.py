"""The decoder over one flattened ragged batch, executing a family's layer plan
(services/common/families/): per layer its attention (global or sliding window, QK-norm, RoPE
base), norm placement and MLP kind (services/worker/mlp.py).

Every scheduled token of every request is one row of the input: prefill chunks and decodes
share a forward pass. Logits are computed only at each request's last scheduled token.

bfloat16 on the CPU is mixed precision (`float32_residual`): the linears' weights, their inputs
and outputs and the KV cache are bfloat16 (half the bytes a step streams), while the residual
stream, the norms, rotary embedding and attention's softmax and sums stay float32 (the C prefill
kernel rounds the softmax weights to bfloat16 for its value products, much as transformers'
bfloat16 attention rounds them). A model
entirely in bfloat16 drifts from float32 within a few tokens; this one keeps greedy output close
to float32's (benchmarks/README.md, "bfloat16 on CPU").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vmesh.kernels.reference import rms_norm_ref, silu_and_mul_ref
from vmesh.services.common.families.plan import LayerPlan
from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.attention import AttentionBackend, AttentionMetadata, CpuAttentionBackend
from vmesh.services.worker.decoder_stack import DecoderStack, stack_kernels, stack_refusal
from vmesh.services.worker.int8_linear import Int8Linear
from vmesh.services.worker.kv_cache import KVCache
from vmesh.services.worker.linear import Linear
from vmesh.services.worker.mlp import DenseMlp, load_mlp
from vmesh.services.worker.quantized_linear import QuantizedLinear, QuantizedWeight, is_plain_quantized, log_placement
from vmesh.services.worker.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels
    from vmesh.services.worker.mlp import AnyLinear
    from vmesh.services.worker.tensor_parallel import TensorParallel


logger = logging.getLogger(__name__)

RopeRows = tuple[torch.Tensor, torch.Tensor]  # cos and sin rows of a step's positions (RotaryEmbedding.tables)


class MissingWeightError(KeyError):
    pass


def float32_residual(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model runs bfloat16 mixed with float32 (the module's docstring): bfloat16 on
    the CPU. CUDA runs whatever dtype it is given throughout, as before."""
    return device.type == "cpu" and dtype == torch.bfloat16


def rms_norm_mixed_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The mixed-precision model's norm in torch (CpuKernels.add_rms_norm's bfloat16 contract, except
    that the residual is a new tensor): x + residual in float32, normalised, rounded to bfloat16."""
    h = x.float() if residual is None else residual + x.float()
    normed = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(torch.bfloat16)
    return normed if residual is None else (normed, h)


def silu_and_mul_mixed_ref(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul computed in float32, rounded to bfloat16 once (as CpuKernels.silu_and_mul in bfloat16)."""
    return silu_and_mul_ref(x.float()).to(torch.bfloat16)


@dataclass(frozen=True)
class FusedOps:
    """RMSNorm (optionally fused with the residual add), SiLU-and-multiply and, where the
    backend has it, rotary embedding fused with the KV-cache write: the torch references by
    default, the Triton kernels alongside the Triton attention backend, the C kernels of
    `vmesh/kernels/cpu` alongside the CPU one, each in a float32 and a mixed bfloat16 variant."""

    rms_norm: Callable
    silu_and_mul: Callable
    # (qkv, heads, kv_heads, cos, sin, key_cache, value_cache, slot_mapping) -> queries; None:
    # RotaryEmbedding.apply and the backend's write_kv as separate steps.
    rotary_write_kv: Callable | None = None

    # What runs them, for the load-time log line.
    description: str = "torch"
    # Whether a quantized linear (QuantizedLinear) takes the norm before it, or SiLU-and-multiply,
    # into its own C call: the C float32 ops, whose kernels those calls run (vmesh/kernels/cpu/fused_linear.c).
    into_quantized_linear: bool = False

    @classmethod
    def for_backend(cls, backend: AttentionBackend, dtype: torch.dtype, mixed: bool = False) -> FusedOps:
        """mixed: the bfloat16 model of `float32_residual`."""
        if backend.name == "triton":
            if mixed:
                raise ValueError("bfloat16 on the CPU runs the cpu or torch attention backend, not triton")
            from vmesh.kernels.fused_ops import rms_norm, silu_and_mul

            return cls(rms_norm, silu_and_mul, description="triton")
        if isinstance(backend, CpuAttentionBackend) and mixed:
            kernels = backend.kernels
            bf16 = torch.bfloat16
            return cls(functools.partial(kernels.add_rms_norm, dtype=bf16),
                       functools.partial(kernels.silu_and_mul, dtype=bf16),
                       functools.partial(kernels.rotary_write_kv, dtype=bf16),
                       description="C (add+RMSNorm, SiLU*mul and rotary+KV write, bfloat16 in and out)")
        if isinstance(backend, CpuAttentionBackend) and dtype == torch.float32:
            kernels = backend.kernels
            return cls(kernels.add_rms_norm, kernels.silu_and_mul, kernels.rotary_write_kv,
                       description="C (add+RMSNorm, SiLU*mul, rotary+KV write)", into_quantized_linear=True)
        if mixed:
            return cls(rms_norm_mixed_ref, silu_and_mul_mixed_ref, description="torch (float32 compute)")
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

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """dtype: other than the model's (the mixed model's float32 norms)."""
        if name not in self.tensors:
            raise MissingWeightError(name)
        tensor = self.tensors[name]
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        return tensor.to(device=self.device, dtype=dtype or self.dtype, copy=True)

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


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """QK-norm: RMSNorm over each head's last dimension, in float32, as transformers computes it."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class DecoderLayer:
    """One layer as its plan (services/common/families/plan.py) describes it."""

    def __init__(self, spec: ModelSpec, plan: LayerPlan, weights: WeightSource, prefix: str,
                 linear: Callable[..., AnyLinear] = Linear, parallel: TensorParallel | None = None):
        self.parallel = parallel  # tensor parallelism: spec and weights are this rank's share
        names, offset = spec.model_plan.names, spec.model_plan.norm_weight_offset
        norm_dtype = torch.float32 if float32_residual(weights.device, weights.dtype) else None

        def norm(name: str) -> torch.Tensor:  # float32 in the mixed bfloat16 model: the norms compute in it
            taken = weights.take(prefix + name, norm_dtype)
            return taken + offset if offset else taken

        def optional(name: str) -> torch.Tensor | None:
            return weights.optional(prefix + name)

        self.spec = spec
        self.plan = plan
        self.input_norm = norm(names.input_norm)
        self.post_attention_norm = norm(names.post_attention_norm)
        sandwich = plan.norms == "sandwich"
        self.pre_mlp_norm = norm(names.pre_mlp_norm) if sandwich else None
        self.post_mlp_norm = norm(names.post_mlp_norm) if sandwich else None
        self.q_norm = norm(names.q_norm) if plan.attention.qk_norm else None
        self.k_norm = norm(names.k_norm) if plan.attention.qk_norm else None
        # q, k and v in one matmul.
        projection = prefix + names.attention
        biases = [b for p in "qkv" if (b := weights.optional(f"{projection.format(p)}.bias")) is not None]
        self.qkv_proj = linear(weights.take_linear(*(f"{projection.format(p)}.weight" for p in "qkv")),
                               torch.cat(biases) if len(biases) == 3 else None)
        self.o_proj = linear(weights.take_linear(f"{projection.format('o')}.weight"),
                             optional(f"{names.attention.format('o')}.bias"))
        self.mlp = load_mlp(plan.mlp, weights, prefix, names, linear)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = plan.attention.scale or spec.head_dim ** -0.5

    def projections(self) -> list[AnyLinear]:
        return [self.qkv_proj, self.o_proj, *self.mlp.projections()]

    def norms(self) -> list[torch.Tensor]:
        return [n for n in (self.input_norm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm,
                            self.q_norm, self.k_norm) if n is not None]

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None, "only for plans with QK-norm"
        spec, eps = self.spec, self.spec.rms_norm_eps
        tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(tokens, spec.num_heads, spec.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, spec.num_kv_heads, spec.head_dim)
        q.copy_(head_rms_norm(q, self.q_norm, eps))
        k.copy_(head_rms_norm(k, self.k_norm, eps))
        return qkv

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it);
        their sum is the layer's output, formed by the next norm."""
        spec = self.spec
        eps = spec.rms_norm_eps
        if ops.into_quantized_linear and is_plain_quantized(self.qkv_proj):
            qkv, residual = self.qkv_proj.after_rms_norm(hidden, self.input_norm, eps, residual)
        elif residual is None:
            x, residual = ops.rms_norm(hidden, self.input_norm, eps), hidden
            qkv = self.qkv_proj(x)
        else:
            x, residual = ops.rms_norm(hidden, self.input_norm, eps, residual)
            qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        if ops.rotary_write_kv is not None:
            q = ops.rotary_write_kv(qkv, spec.num_heads, spec.num_kv_heads, *rope, key_cache, value_cache,
                                    meta.slot_mapping)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Queries and keys rotate in one pass.
            qk = RotaryEmbedding.apply(qk.reshape(-1, spec.num_heads + spec.num_kv_heads, spec.head_dim), *rope)
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            v = v.reshape(-1, spec.num_kv_heads, spec.head_dim)
            # (In the mixed bfloat16 model float32 tables promote q and k to float32; a bfloat16 cache
            # rounds k, an 8-bit one quantizes it as it is, and q is rounded as rotary_write_kv_bf16
            # rounds it, so that every path attends alike.)
            backend.write_kv(k if key_cache.dtype == torch.int8 else k.to(key_cache.dtype), v, key_cache,
                             value_cache, meta.slot_mapping)
            if q.dtype == torch.float32 and qkv.dtype == torch.bfloat16:
                q = q.to(torch.bfloat16).float()
        attn = backend.attend(q, key_cache, value_cache, meta, self.scale, self.plan.attention.window)
        attn_out = self.o_proj(attn.reshape(-1, self.q_size))
        if self.parallel is not None:  # row-parallel: each rank's product is a partial sum
            attn_out = self.parallel.all_reduce(attn_out)
        if self.pre_mlp_norm is not None:  # sandwich: the branch's output is normed before it joins
            attn_out = ops.rms_norm(attn_out.float().contiguous(), self.post_attention_norm, eps)
            x, residual = ops.rms_norm(attn_out, self.pre_mlp_norm, eps, residual)
            mlp_out = self.mlp(x, ops)
        elif isinstance(self.mlp, DenseMlp) and self.mlp.takes_norm(ops):
            mlp_out, residual = self.mlp.after_rms_norm(attn_out, self.post_attention_norm, eps, residual, ops)
        else:
            x, residual = ops.rms_norm(attn_out, self.post_attention_norm, eps, residual)
            mlp_out = self.mlp(x, ops)
        if self.parallel is not None:
            mlp_out = self.parallel.all_reduce(mlp_out)
        if self.post_mlp_norm is not None:
            mlp_out = ops.rms_norm(mlp_out.float().contiguous(), self.post_mlp_norm, eps)
        return mlp_out, residual


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor | QuantizedWeight], device: torch.device,
                 dtype: torch.dtype, max_positions: int, cpu_kernels: CpuKernels | None = None,
                 quantized_kernels: CpuKernels | None = None, parallel: TensorParallel | None = None,
                 int8_kernels: CpuKernels | None = None):
        """quantized_kernels: `--weights native`, linears kept as GGUF blocks where the kernel reads them.
        int8_kernels: `--weights int8`, every float linear quantized to int8 here (int8_linear.py)."""
        source = WeightSource(weights, device, dtype, keep_quantized=quantized_kernels is not None)
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.mixed = float32_residual(device, dtype)
        self.parallel = parallel
        names = spec.model_plan.names
        embed = source.take_linear(names.embed) if spec.tie_word_embeddings else source.take(names.embed)
        plain_linear = functools.partial(Linear, small_batch_kernels=cpu_kernels)

        def linear(weight: torch.Tensor | QuantizedWeight,
                   bias: torch.Tensor | None = None) -> AnyLinear:
            if isinstance(weight, QuantizedWeight):
                assert quantized_kernels is not None, "weights stay quantized only with the kernels that read them"
                return QuantizedLinear(weight, bias, quantized_kernels)
            if int8_kernels is not None:
                return Int8Linear(weight, bias, int8_kernels)
            return plain_linear(weight, bias)

        self.layers = [DecoderLayer(spec, plan, source, names.layer.format(i), linear, parallel)
                       for i, plan in enumerate(spec.layers)]
        self.final_norm = source.take(names.final_norm, torch.float32 if self.mixed else None)
        if spec.model_plan.norm_weight_offset:
            self.final_norm += spec.model_plan.norm_weight_offset
        # A fifth of all FLOPs for small models, so it is packed like every linear. A tied
        # head also serves the embedding lookups when its rows can be read back, so that the
        # table is held once; otherwise the plain table stays for them.
        self.lm_head = linear(embed if spec.tie_word_embeddings else source.take_linear(names.lm_head))
        lookups_from_head = spec.tie_word_embeddings and self.lm_head.weight is None and self.lm_head.rows_readable
        self.embed: torch.Tensor | None = None
        if not lookups_from_head:
            assert isinstance(embed, torch.Tensor), "a quantized table serves the lookups from the head"
            self.embed = embed
        # One table per distinct RoPE base and scaling (Gemma 3's local and global layers differ).
        rope_dtype = torch.float32 if self.mixed else dtype
        self.rotaries: dict[tuple[float, str], RotaryEmbedding] = {}
        for plan in spec.layers:  # built once per key, not once per layer (Gemma 3: 2 of 18)
            if plan.attention.rope_key not in self.rotaries:
                self.rotaries[plan.attention.rope_key] = RotaryEmbedding(plan.attention, spec.head_dim, max_positions,
                                                                         device, rope_dtype)
        self.rotary = self.rotaries[spec.layers[0].attention.rope_key]  # the first layer's (of most models, all's)
        self.quantized_kernels = quantized_kernels
        # None until the first step decides (_decoder_stack); False runs the layers one by one
        # (benchmarks/step_breakdown.py sets it to see each op).
        self.decoder_stack_enabled: bool | None = None
        self.decoder_stack: DecoderStack | None = None
        if source.keep_quantized:
            log_placement(self.linears(), source.dequantized)
        logger.info("weights: %s", ", ".join(f"{name} {size / (1 << 20):.1f} MiB"
                                             for name, size in self.held_bytes().items()))

    def linears(self) -> list[AnyLinear]:
        return [self.lm_head] + [p for layer in self.layers for p in layer.projections()]

    def held_bytes(self) -> dict[str, int]:
        """Bytes of weights held per representation: oneDNN's packed linears, plain linear weights
        (a small-batch copy, or the only one where nothing is packed), the plain embedding table
        (0 when the tied LM head's copy serves the lookups), and the rest (norms, biases)."""
        embedding = self.embed.nbytes if self.embed is not None else 0
        held = {"packed oneDNN": 0, "plain linear": 0, "quantized GGUF": 0, "int8": 0, "embedding": embedding,
                "norms and biases": 0}
        kinds = {"packed": "packed oneDNN", "plain": "plain linear", "quantized": "quantized GGUF", "int8": "int8"}
        for layer in self.linears():
            for representation, size in layer.held_bytes().items():
                if representation == "plain" and layer.weight is self.embed:
                    continue  # the embedding table, counted once
                held[kinds[representation]] += size
            held["norms and biases"] += layer.bias.nbytes if layer.bias is not None else 0
        norms = [self.final_norm] + [n for layer in self.layers for n in layer.norms()]
        held["norms and biases"] += sum(n.nbytes for n in norms)
        return held

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows, in the residual stream's dtype (float32 in the mixed model)."""
        ids = input_ids if self.parallel is None else self.parallel.local_token_ids(input_ids)
        rows = self.embed[ids] if self.embed is not None else self.lm_head.weight_rows(ids)
        if self.parallel is not None:  # vocab-parallel: the rank holding each token's row supplies it
            rows = self.parallel.reduce_embedding(rows, input_ids)
        scale = self.spec.model_plan.embedding_scale
        if scale is not None:  # rounded to the table's dtype first, as transformers' Gemma does
            rows = rows * torch.tensor(scale, dtype=rows.dtype)
        return rows.float() if self.mixed else rows

    def fused_ops(self, backend: AttentionBackend) -> FusedOps:
        return FusedOps.for_backend(backend, self.dtype, self.mixed)

    def describe_placement(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> str:
        """What runs where, in one line (logged once at load): the linears, attention and the KV
        cache, the elementwise ops, and the residual stream's dtype."""
        kinds: dict[str, int] = {}
        for layer in self.linears():
            kind = layer.kernel_description if not isinstance(layer, QuantizedLinear) else "GGUF blocks (C)"
            kinds[kind] = kinds.get(kind, 0) + 1
        linears = "; ".join(f"{n} x {kind}" for kind, n in kinds.items())
        attention = {"cpu": "C kernels", "torch": "torch", "triton": "Triton"}.get(backend.name, backend.name)
        residual = "float32" if self.mixed else str(self.dtype).removeprefix("torch.")
        return (f"{str(self.dtype).removeprefix('torch.')} on {self.device.type}: linears {linears}; attention "
                f"{attention}, KV cache {str(kv_dtype).removeprefix('torch.')}; elementwise ops "
                f"{self.fused_ops(backend).description}; residual stream {residual}")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | Sequence[AttentionMetadata], kv_cache: KVCache, backend: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits at `logits_indices` of the step's flattened positions."""
        return self.compute_logits(self.final_hidden(input_ids, positions, meta, kv_cache, backend, logits_indices))

    @torch.inference_mode()
    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata | Sequence[AttentionMetadata], kv_cache: KVCache,
                     backend: AttentionBackend, indices: torch.Tensor) -> torch.Tensor:
        """The final hidden states at `indices` of the step's flattened positions: after the final
        norm, what the LM head reads (an embedding request pools them). `meta`: one per KV cache
        group, each layer reading its group's (a single one serves a one-group cache)."""
        metas = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
        if len(metas) != kv_cache.num_groups:
            raise ValueError(f"{len(metas)} attention metadata for {kv_cache.num_groups} KV cache groups")
        hidden = self.embed_tokens(input_ids)
        ropes = {key: rotary.tables(positions) for key, rotary in self.rotaries.items()}
        ops = self.fused_ops(backend)
        stack = self._decoder_stack()
        if stack is not None and stack.serves(backend, kv_cache, input_ids.numel()):
            hidden, residual = stack.run(hidden, ropes[self.layers[0].plan.attention.rope_key], metas[0], kv_cache,
                                         backend)
        else:
            hidden, residual = self._layers_one_by_one(hidden, ropes, metas, kv_cache, backend, ops)
        last, _ = ops.rms_norm(hidden[indices], self.final_norm, self.spec.rms_norm_eps, residual[indices])
        return last

    def _decoder_stack(self) -> DecoderStack | None:
        """The layers as one C call where they all allow it (services/worker/decoder_stack.py):
        decided at the first step, once LoRA has wrapped whatever it wraps, and kept."""
        if self.decoder_stack_enabled is None:
            kernels = stack_kernels(self)
            refusal = stack_refusal(self)
            if refusal is None and kernels is None:
                refusal = "weights neither kept quantized nor int8"
            if kernels is not None and refusal is None:
                self.decoder_stack = DecoderStack(self, kernels)
            self.decoder_stack_enabled = self.decoder_stack is not None
            logger.info("decoder layers: %s", "one C call (decoder_stack.c)" if refusal is None
                        else f"one by one ({refusal})")
        return self.decoder_stack if self.decoder_stack_enabled else None

    def _layers_one_by_one(self, hidden: torch.Tensor, ropes: dict[tuple[float, str], RopeRows],
                           metas: list[AttentionMetadata], kv_cache: KVCache, backend: AttentionBackend,
                           ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it): each layer's ops from Python."""
        residual = None
        for i, layer in enumerate(self.layers):
            rope = ropes[layer.plan.attention.rope_key]
            hidden, residual = layer.forward(hidden, residual, rope, kv_cache.key_caches[i], kv_cache.value_caches[i],
                                             metas[kv_cache.group_of_layer[i]], backend, ops)
        assert residual is not None, "the model has at least one layer"
        return hidden, residual

    @torch.inference_mode()
    def compute_logits(self, last: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states (final_hidden's), float32 over the whole vocabulary."""
        logits = self.lm_head(last).float()
        if self.parallel is not None:  # each rank holds a vocabulary slice; all sample from the whole
            logits = self.parallel.gather_logits(logits, self.spec.vocab_size)
        return logits
