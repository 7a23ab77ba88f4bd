"""Every decoder layer of a quantized (`--weights native`) Llama-shaped model in one C call
(kernels/cpu/decoder_stack.c) instead of six calls per layer from Python.

At one stream the per-op path spent about a third of its decode step in the Python, checks, output
tensors and ctypes dispatch around ~180 kernel calls; here the same kernels run in the same order
from C, so the output is the same bit for bit (tests/unit/test_decoder_stack.py). Shapes are
checked once per step, and the scratch buffers are tensors made here.

The stack serves the models whose layers are all plain: float32, one KV cache group, no tensor
parallelism, pre-norm layers without QK-norm, a SiLU MLP, every projection a plain QuantizedLinear
(a LoRA wrapper reads its own input), one RoPE table. Any other model, or a step on another
attention backend, runs the per-op path (DecoderLayer.forward).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from vmesh.kernels.cpu_checks import attention_shape, require_contiguous_cpu
from vmesh.services.worker.attention import AttentionMetadata, CpuAttentionBackend
from vmesh.services.worker.mlp import DenseMlp
from vmesh.services.worker.quantized_linear import is_plain_quantized

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels
    from vmesh.services.worker.kv_cache import KVCache
    from vmesh.services.worker.model import DecoderModel

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", P), ("post_attention_norm", P), ("qkv", P), ("o", P), ("gate_up", P), ("down", P),
                ("qkv_bias", P), ("o_bias", P), ("gate_up_bias", P), ("down_bias", P), ("qkv_format", I32),
                ("o_format", I32), ("gate_up_format", I32), ("down_format", I32), ("key_cache", P),
                ("value_cache", P), ("scale", F32), ("window", I64)]


class StackAttention(ctypes.Structure):
    _fields_ = [("block_tables", P), ("table_width", I64), ("request_rows", P), ("token_rows", P),
                ("context_lens", P), ("num_items", I64), ("chunk_requests", P), ("chunk_starts", P),
                ("chunk_lens", P), ("chunk_seq_lens", P), ("num_chunks", I64)]


class StackShape(ctypes.Structure):
    _fields_ = [("hidden", I64), ("heads", I64), ("kv_heads", I64), ("head_dim", I64), ("intermediate", I64),
                ("block_size", I64), ("eps", F32), ("integer", I32)]


def stack_refusal(model: DecoderModel) -> str | None:
    """Why the model's layers cannot run as one C call, or None when they can."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not a float32 model on the CPU"
    if model.parallel is not None:
        return "tensor parallel"
    if len(model.rotaries) != 1:
        return "more than one RoPE table"
    for layer in model.layers:
        if layer.pre_mlp_norm is not None or layer.q_norm is not None:
            return "sandwich norms or QK-norm"
        if not isinstance(layer.mlp, DenseMlp) or layer.mlp.plan.activation != "silu":
            return "not a SiLU MLP"
        if not all(is_plain_quantized(p) for p in layer.projections()):
            return "a projection that is not a plain quantized linear"
    products = [p._product for layer in model.layers for p in layer.projections()]  # type: ignore[union-attr]
    if len({p.integer for p in products}) != 1:
        return "integer and float products mixed"
    return None


class DecoderStack:
    """The layers of one model (stack_refusal None) as kernels/cpu/decoder_stack.c reads them."""

    def __init__(self, model: DecoderModel, kernels: CpuKernels):
        refusal = stack_refusal(model)
        if refusal is not None:
            raise ValueError(f"the decoder stack does not serve this model: {refusal}")
        self.model = model
        spec = model.spec
        first = model.layers[0]
        self.kernels = kernels
        self.shape = StackShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                first.mlp.down_proj.in_features, 0, spec.rms_norm_eps,  # type: ignore[union-attr]
                                first.qkv_proj._product.integer)  # type: ignore[union-attr]
        self.qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self.layers = (StackLayer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers, strict=True):
            mlp = layer.mlp
            assert isinstance(mlp, DenseMlp)
            entry.input_norm = layer.input_norm.data_ptr()
            entry.post_attention_norm = layer.post_attention_norm.data_ptr()
            for name, linear in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                blocks, block_format, bias = linear._product._weight  # type: ignore[union-attr]
                setattr(entry, name, blocks)
                setattr(entry, f"{name}_format", block_format)
                setattr(entry, f"{name}_bias", bias or None)
            entry.scale = layer.scale
            entry.window = layer.plan.attention.window or 0
        for norm in (n for layer in model.layers for n in (layer.input_norm, layer.post_attention_norm)):
            require_contiguous_cpu(("norm", norm, torch.float32))
        self._caches: KVCache | None = None  # the KV cache whose tensors self.layers points at

    def serves(self, metas: list[AttentionMetadata], kv_cache: KVCache, backend: object) -> bool:
        """Whether this step can run as one call: the C attention backend, over one float32 cache group."""
        return (isinstance(backend, CpuAttentionBackend) and len(metas) == 1 and kv_cache.num_groups == 1
                and kv_cache.key_caches[0].dtype == torch.float32)

    def _point_at(self, kv_cache: KVCache, backend: CpuAttentionBackend) -> None:
        """Checks the caches once (every layer's has the first one's shape) and points the layers at them."""
        first = kv_cache.key_caches[0]
        spec = self.model.spec
        if first.dim() != 4 or tuple(first.shape[2:]) != (spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"a KV cache of shape {tuple(first.shape)} does not fit {spec.num_kv_heads} KV heads "
                             f"of {spec.head_dim}")
        if spec.num_heads > backend.kernels.max_heads or spec.head_dim > backend.kernels.max_head_dim:
            raise ValueError(f"{spec.num_heads} heads of {spec.head_dim} exceed the attention kernels' limits")
        for entry, key, value in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches, strict=True):
            require_contiguous_cpu(("key_cache", key, torch.float32), ("value_cache", value, torch.float32))
            if key.shape != first.shape or value.shape != first.shape:
                raise ValueError("every layer's KV cache must have the first layer's shape")
            entry.key_cache, entry.value_cache = key.data_ptr(), value.data_ptr()
        self.shape.block_size = first.shape[1]
        self._caches = kv_cache

    def run(self, embeddings: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
            kv_cache: KVCache, backend: CpuAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), as the per-op loop over
        DecoderLayer.forward returns them; `embeddings` becomes the stream (updated in place)."""
        if self._caches is not kv_cache:
            self._point_at(kv_cache, backend)
        spec = self.model.spec
        tokens = embeddings.shape[0]
        cos, sin = rope
        require_contiguous_cpu(("embeddings", embeddings, torch.float32), ("cos", cos, torch.float32),
                               ("sin", sin, torch.float32), ("slot_mapping", meta.slot_mapping, torch.int64))
        if embeddings.shape != (tokens, spec.hidden_size) or cos.numel() != tokens * spec.head_dim \
                or sin.numel() != cos.numel() or meta.slot_mapping.numel() != tokens:
            raise ValueError(f"embeddings {tuple(embeddings.shape)}, rope and slot mapping do not fit {tokens} tokens")
        items, chunks = backend.step_plan(meta, kv_cache.key_caches[0])
        qkv = torch.empty(tokens, self.qkv_width)
        attention = torch.empty(tokens, spec.num_heads, spec.head_dim)
        query = qkv[:, :spec.num_heads * spec.head_dim].view(tokens, spec.num_heads, spec.head_dim)
        work = StackAttention()
        key, value = kv_cache.key_caches[0], kv_cache.value_caches[0]
        if items is not None:
            attention_shape(query, key, value, attention, items)  # every layer's shapes are the first's
            work.block_tables, work.table_width = items.block_tables.data_ptr(), items.block_tables.shape[1]
            work.request_rows, work.token_rows = items.request_rows.data_ptr(), items.token_rows.data_ptr()
            work.context_lens, work.num_items = items.context_lens.data_ptr(), items.token_rows.numel()
        if chunks is not None:
            attention_shape(query, key, value, attention, chunks)
            work.block_tables, work.table_width = chunks.block_tables.data_ptr(), chunks.block_tables.shape[1]
            work.chunk_requests, work.chunk_starts = chunks.requests.data_ptr(), chunks.starts.data_ptr()
            work.chunk_lens, work.chunk_seq_lens = chunks.lengths.data_ptr(), chunks.seq_lens.data_ptr()
            work.num_chunks = chunks.requests.numel()
        hidden = torch.empty(tokens, spec.hidden_size)
        attention_out = torch.empty(tokens, spec.hidden_size)
        gate_up = torch.empty(tokens, 2 * self.shape.intermediate)
        # Looked up per call, as every kernel is (benchmarks/step_breakdown.py times them).
        stack = self.kernels._functions["decoder_stack_f32"]
        status = stack(hidden.data_ptr(), embeddings.data_ptr(), tokens, self.layers, len(self.layers),
                       ctypes.byref(self.shape), ctypes.byref(work), cos.data_ptr(), sin.data_ptr(),
                       meta.slot_mapping.data_ptr(), qkv.data_ptr(), attention.data_ptr(), attention_out.data_ptr(),
                       gate_up.data_ptr(), torch.get_num_threads())
        if status:
            layer, code = divmod(status, 16)
            kind = {2: MemoryError, 3: RuntimeError}.get(code, ValueError)
            raise kind(f"decoder stack: layer {layer - 1}'s kernel refused the step (status {code})")
        return hidden, embeddings
