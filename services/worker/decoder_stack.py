"""Every decoder layer of a Llama-shaped model in one C call (vmesh/kernels/cpu/decoder_stack.c)
instead of six to nine calls per layer from Python, in two modes: quantized (`--weights native`,
float32) and `--weights int8 --dtype bfloat16`.

At one stream the Python, checks, output tensors and ctypes dispatch around the per-op path's ~180
kernel calls cost a fifth to a quarter of a decode step (benchmarks/README.md, "The decoder layers
in one C call"); here the same kernels run in the same order from C, so the output is the same bit
for bit (tests/integration/test_decoder_stack.py). Every layer's shapes are checked when the stack
is built, the step's once per step, and the scratch buffers are tensors made here.

The stack serves the models whose layers are all plain: one KV cache group, no tensor
parallelism, pre-norm layers without QK-norm, a SiLU MLP, one RoPE table, heads within the C
attention kernels' limits, and every projection either a plain QuantizedLinear of a float32 model
or a plain Int8Linear with its 8-bit block copy in the mixed bfloat16 model (a LoRA wrapper reads
its own input). The int8 stack takes steps of BLOCK_PATH_MIN_ROWS rows or more, where every
product is the block one; fewer rows, and any other model, or a step on another attention
backend or cache group layout, run the per-op path (DecoderLayer.forward). The decision is made at
the first step (LoRA wraps its layers at load).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, TypeGuard

import torch

from vmesh.kernels.cpu_checks import attention_shape, cache_head_dim, int8_block_weight, require_contiguous_cpu
from vmesh.kernels.cpu_native import kernel_status_error
from vmesh.services.worker.attention import AttentionMetadata, CpuAttentionBackend
from vmesh.services.worker.int8_linear import BLOCK_PATH_MIN_ROWS, Int8Linear
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


class Int8StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", P), ("post_attention_norm", P), ("qkv", P), ("o", P), ("gate_up", P), ("down", P),
                ("qkv_scale", P), ("o_scale", P), ("gate_up_scale", P), ("down_scale", P), ("qkv_bias", P),
                ("o_bias", P), ("gate_up_bias", P), ("down_bias", P), ("key_cache", P), ("value_cache", P),
                ("scale", F32), ("window", I64)]


class StackAttention(ctypes.Structure):
    _fields_ = [("block_tables", P), ("table_width", I64), ("request_rows", P), ("token_rows", P),
                ("context_lens", P), ("num_items", I64), ("chunk_requests", P), ("chunk_starts", P),
                ("chunk_lens", P), ("chunk_seq_lens", P), ("num_chunks", I64)]


class StackShape(ctypes.Structure):
    _fields_ = [("hidden", I64), ("heads", I64), ("kv_heads", I64), ("head_dim", I64), ("intermediate", I64),
                ("block_size", I64), ("eps", F32), ("integer", I32), ("kv_int8", I32)]


# vmesh/kernels/cpu/decoder_stack.c's kernels of a layer, in its order.
STACK_KERNELS = ("norm + q/k/v product", "decode attention", "prefill attention", "o product",
                 "norm + gate/up product", "SiLU + down product")


def is_plain_int8(linear: object) -> TypeGuard[Int8Linear]:
    """An Int8Linear itself (not a wrapper) with the packed copy the block product reads."""
    return type(linear) is Int8Linear and linear.blocks is not None


def stack_refusal(model: DecoderModel) -> str | None:
    """Why the model's layers cannot run as one C call, or None when they can."""
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return "not a float32 or bfloat16 model on the CPU"
    if model.parallel is not None:
        return "tensor parallel"
    if len(model.rotaries) != 1:
        return "more than one RoPE table"
    for layer in model.layers:
        if layer.pre_mlp_norm is not None or layer.q_norm is not None:
            return "sandwich norms or QK-norm"
        if not isinstance(layer.mlp, DenseMlp) or layer.mlp.plan.activation != "silu":
            return "not a SiLU MLP"
    projections = [p for layer in model.layers for p in layer.projections()]
    if model.dtype == torch.bfloat16:
        if not all(is_plain_int8(p) for p in projections):
            return "a bfloat16 model whose projections are not all plain int8 linears with 8-bit blocks"
    else:
        if not all(is_plain_quantized(p) for p in projections):
            return "a projection that is not a plain quantized linear"
        if len({p._product.integer for p in projections}) != 1:  # type: ignore[union-attr]
            return "integer and float products mixed"
    spec, kernels = model.spec, stack_kernels(model)
    if kernels is not None and (spec.num_heads > kernels.max_heads or spec.head_dim > kernels.max_head_dim):
        return "heads beyond the C attention kernels' limits"  # the per-op path attends in torch then
    return None


def stack_kernels(model: DecoderModel) -> CpuKernels | None:
    """The kernels the model's linears run on: the quantized ones, or the int8 layers' (None: neither)."""
    if model.quantized_kernels is not None:
        return model.quantized_kernels
    first = model.layers[0].qkv_proj if model.layers else None
    return first.kernels if isinstance(first, Int8Linear) else None


class DecoderStack:
    """The layers of one model (stack_refusal None) as vmesh/kernels/cpu/decoder_stack.c reads them."""

    def __init__(self, model: DecoderModel, kernels: CpuKernels):
        refusal = stack_refusal(model)
        if refusal is not None:
            raise ValueError(f"the decoder stack does not serve this model: {refusal}")
        self.model = model
        # The mixed bfloat16 model with int8 linears (decoder_stack_int8_bf16), else native float32.
        self.int8 = model.dtype == torch.bfloat16
        self.cache_dtype = torch.bfloat16 if self.int8 else torch.float32
        spec = model.spec
        first_mlp = model.layers[0].mlp
        assert isinstance(first_mlp, DenseMlp)
        intermediate = first_mlp.down_proj.in_features
        if spec.num_kv_heads < 1 or spec.num_heads % spec.num_kv_heads or spec.head_dim % 2:
            raise ValueError(f"{spec.num_heads} heads over {spec.num_kv_heads} KV heads of {spec.head_dim}")
        self.kernels = kernels
        self.qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        attention_width = spec.num_heads * spec.head_dim
        # (in, out) features C assumes of each projection: it takes the sizes from the shape, not the weights.
        expected = {"qkv": (spec.hidden_size, self.qkv_width), "o": (attention_width, spec.hidden_size),
                    "gate_up": (spec.hidden_size, 2 * intermediate), "down": (intermediate, spec.hidden_size)}
        self.layers = ((Int8StackLayer if self.int8 else StackLayer) * len(model.layers))()
        # What the layers' addresses point into, held as long as the stack is (the model may drop them).
        self._held: list[object] = []
        integer = set()
        for i, (entry, layer) in enumerate(zip(self.layers, model.layers, strict=True)):
            mlp = layer.mlp
            assert isinstance(mlp, DenseMlp)
            for norm in (layer.input_norm, layer.post_attention_norm):
                require_contiguous_cpu(("norm", norm, torch.float32))
                if norm.shape != (spec.hidden_size,):
                    raise ValueError(f"layer {i}: a norm of shape {tuple(norm.shape)} for {spec.hidden_size} features")
            entry.input_norm = layer.input_norm.data_ptr()
            entry.post_attention_norm = layer.post_attention_norm.data_ptr()
            for name, linear in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                features = (linear.in_features, linear.out_features)
                if features != expected[name]:
                    raise ValueError(f"layer {i}: {name} is {features[0]} -> {features[1]} features, not "
                                     f"{expected[name][0]} -> {expected[name][1]}")
                if self.int8:
                    assert is_plain_int8(linear)
                    self._point_at_int8(entry, name, linear)
                else:
                    product = linear._product  # type: ignore[union-attr]
                    blocks, block_format, bias = product.pointers
                    setattr(entry, name, blocks)
                    setattr(entry, f"{name}_format", block_format)
                    setattr(entry, f"{name}_bias", bias or None)
                    integer.add(product.integer)
                    self._held.append(product)
            self._held += [layer.input_norm, layer.post_attention_norm]
            entry.scale = layer.scale
            entry.window = layer.plan.attention.window or 0
        self.shape = StackShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, intermediate,
                                0, spec.rms_norm_eps, integer.pop() if integer else 0)  # stack_refusal: one kind
        # The KV cache whose tensors self.layers points at, and those tensors (held).
        self._caches: tuple[KVCache, list[torch.Tensor]] | None = None

    def _point_at_int8(self, entry: Int8StackLayer, name: str, linear: Int8Linear) -> None:
        """The packed copy, scales and bias of one int8 projection, checked as
        CpuKernels.int8_block_linear checks them per call."""
        blocks, scale, bias = linear.blocks, linear.scale, linear.bias
        assert blocks is not None
        if linear.out_dtype != torch.bfloat16:  # the C writes every product's output in bfloat16
            raise ValueError(f"{name}: an int8 linear with {linear.out_dtype} outputs in a bfloat16 stack")
        features = int8_block_weight(blocks, scale, bias, self.kernels.int8_block_inputs)
        if features != (linear.out_features, linear.in_features):
            raise ValueError(f"{name}: its packed weight is {features[1]} -> {features[0]} features, not "
                             f"{linear.in_features} -> {linear.out_features}")
        setattr(entry, name, blocks.data_ptr())
        setattr(entry, f"{name}_scale", scale.data_ptr())
        setattr(entry, f"{name}_bias", bias.data_ptr() if bias is not None else None)
        self._held += [blocks, scale, bias]

    def serves(self, backend: object, kv_cache: KVCache, tokens: int) -> TypeGuard[CpuAttentionBackend]:
        """Whether this step can run as one call: the C attention backend over one cache group of this
        mode's dtype, and (int8) enough rows that every product is the 8-bit block one."""
        return (isinstance(backend, CpuAttentionBackend) and kv_cache.num_groups == 1
                and kv_cache.key_caches[0].dtype in (self.cache_dtype, torch.int8)
                and (not self.int8 or tokens >= BLOCK_PATH_MIN_ROWS))

    def _point_at(self, kv_cache: KVCache) -> None:
        """Checks the caches once (every layer's has the first one's shape) and points the layers at them."""
        first = kv_cache.key_caches[0]
        spec = self.model.spec
        if (first.dim() != 4 or first.dtype not in (self.cache_dtype, torch.int8)
                or (first.shape[2], cache_head_dim(first)) != (spec.num_kv_heads, spec.head_dim)):
            raise ValueError(f"a {first.dtype} KV cache of shape {tuple(first.shape)} does not fit "
                             f"{spec.num_kv_heads} KV heads of {spec.head_dim}")
        for entry, key, value in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches, strict=True):
            require_contiguous_cpu(("key_cache", key, first.dtype), ("value_cache", value, first.dtype))
            if key.shape != first.shape or value.shape != first.shape:
                raise ValueError("every layer's KV cache must have the first layer's shape")
            entry.key_cache, entry.value_cache = key.data_ptr(), value.data_ptr()
        self.shape.block_size = first.shape[1]
        self.shape.kv_int8 = int(first.dtype == torch.int8)
        self._caches = (kv_cache, [*kv_cache.key_caches, *kv_cache.value_caches])

    def _points_at(self, kv_cache: KVCache) -> bool:
        """Whether the layers point at this cache's tensors (O(1): a cache's tensors are replaced whole)."""
        return (self._caches is not None and self._caches[0] is kv_cache
                and self._caches[1][0] is kv_cache.key_caches[0] and self._caches[1][-1] is kv_cache.value_caches[-1])

    def run(self, embeddings: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
            kv_cache: KVCache, backend: CpuAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), as the per-op loop over
        DecoderLayer.forward returns them; `embeddings` (float32) becomes the stream (updated in place)."""
        if not self._points_at(kv_cache):
            self._point_at(kv_cache)
        spec = self.model.spec
        tokens = embeddings.shape[0]
        cos, sin = rope
        require_contiguous_cpu(("embeddings", embeddings, torch.float32), ("cos", cos, torch.float32),
                               ("sin", sin, torch.float32), ("slot_mapping", meta.slot_mapping, torch.int64))
        if embeddings.shape != (tokens, spec.hidden_size) or cos.numel() != tokens * spec.head_dim \
                or sin.numel() != cos.numel() or meta.slot_mapping.numel() != tokens:
            raise ValueError(f"embeddings {tuple(embeddings.shape)}, rope and slot mapping do not fit {tokens} tokens")
        activations = self.cache_dtype  # the linears' inputs and outputs: bfloat16 in the int8 mode
        hidden = torch.empty(tokens, spec.hidden_size, dtype=activations)
        qkv = torch.empty(tokens, self.qkv_width, dtype=activations)
        attention = torch.empty(tokens, spec.num_heads, spec.head_dim)
        attention_out = torch.empty(tokens, spec.hidden_size, dtype=activations)
        gate_up = torch.empty(tokens, 2 * self.shape.intermediate, dtype=activations)
        scratch: tuple[torch.Tensor, ...]
        if self.int8:  # rotary_write_kv_bf16 writes the rounded queries apart, as float32
            query = torch.empty(tokens, spec.num_heads, spec.head_dim)
            normed = torch.empty(tokens, spec.hidden_size, dtype=activations)
            activated = torch.empty(tokens, self.shape.intermediate, dtype=activations)
            scratch = (normed, qkv, query, attention, attention_out, gate_up, activated)
        else:  # rotated in place
            query = qkv[:, :spec.num_heads * spec.head_dim].view(tokens, spec.num_heads, spec.head_dim)
            scratch = (qkv, attention, attention_out, gate_up)
        work = self._attention_work(meta, kv_cache, backend, query, attention)
        # Looked up per call, as every kernel is (benchmarks/step_breakdown.py times them).
        stack = self.kernels._functions["decoder_stack_int8_bf16" if self.int8 else "decoder_stack_f32"]
        status = stack(hidden.data_ptr(), embeddings.data_ptr(), tokens, self.layers, len(self.layers),
                       ctypes.byref(self.shape), ctypes.byref(work), cos.data_ptr(), sin.data_ptr(),
                       meta.slot_mapping.data_ptr(), *(t.data_ptr() for t in scratch), torch.get_num_threads())
        if status:
            layer, rest = divmod(status, 256)
            kernel, code = divmod(rest, 16)
            raise kernel_status_error(code, f"decoder stack, layer {layer - 1}'s {STACK_KERNELS[kernel]}",
                                      f"the step's shapes (status {code})")
        return hidden, embeddings

    def _attention_work(self, meta: AttentionMetadata, kv_cache: KVCache, backend: CpuAttentionBackend,
                        query: torch.Tensor, attention: torch.Tensor) -> StackAttention:
        """The step's decode items and prefill chunks, checked against the first layer's cache (every
        layer's has its shape) and the query and output buffers the kernels will read and write."""
        items, chunks = backend.step_plan(meta, kv_cache.key_caches[0])
        # Both kernels' work reads the step's one block table (CpuAttentionBackend._plan builds both from it).
        work = StackAttention(block_tables=meta.block_tables.data_ptr(), table_width=meta.block_tables.shape[1])
        key, value = kv_cache.key_caches[0], kv_cache.value_caches[0]
        if items is not None:
            assert items.block_tables is meta.block_tables
            attention_shape(query, key, value, attention, items)
            work.request_rows, work.token_rows = items.request_rows.data_ptr(), items.token_rows.data_ptr()
            work.context_lens, work.num_items = items.context_lens.data_ptr(), items.token_rows.numel()
        if chunks is not None:
            assert chunks.block_tables is meta.block_tables
            attention_shape(query, key, value, attention, chunks)
            work.chunk_requests, work.chunk_starts = chunks.requests.data_ptr(), chunks.starts.data_ptr()
            work.chunk_lens, work.chunk_seq_lens = chunks.lengths.data_ptr(), chunks.seq_lens.data_ptr()
            work.num_chunks = chunks.requests.numel()
        return work
