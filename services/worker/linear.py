"""Linear layers with the weight laid out once, at load time, for the device's fastest kernel.

On CPU, torch's default `F.linear` goes through MKL; oneDNN with the weight reordered once into
its blocked layout is markedly faster at every batch size, the tied LM head included (figures
in benchmarks/README.md). inductor uses the same two ops for frozen CPU linears. Elsewhere
(CUDA) `F.linear` is already the fast path.

For one row up to the kernels' `stream_rows` (vmesh/kernels/cpu/kernel_limits.h: 6, so that a single
stream's speculative verification of 1 + k rows stays on it) the layer is a pass over its weights,
which `vmesh/kernels/cpu/small_batch_linear.c` streams faster than oneDNN does. It reads oneDNN's
packed copy itself: for float32 on AVX-512 that layout (OI16i64o) stores each block of 64
output features as the transpose of their weight rows, already the layout a matrix-vector
product wants. Each weight is therefore held once. Where oneDNN picks another layout (another
instruction set), checked weight by weight at load, the layer keeps a plain copy for the
small-batch kernel instead, and says so in `held_bytes`.

bfloat16 weights (the bfloat16 model on CPU) are packed as AB16b64a2b on AVX-512 and AB16b32a2b
with AMX: blocks of 64 (32) output features, each input pair's two weights side by side. The
small-batch kernel reads both (checked the same way); where it is neither, those rows go to oneDNN,
and no plain copy is kept. Past the streaming rows and up to BATCH_BF16_MAX_ROWS, a layer in the
64-wide layout (AVX-512 without AMX) multiplies on `vmesh/kernels/cpu/batch_linear_bf16.c`, AVX-512
BF16 dot products over the same packed copy, which oneDNN's products of a few dozen rows trail;
with AMX, oneDNN's tile products serve every row count past the streaming pass.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for an expected row count; one layout serves every row
# count well, and this hint was the best of 1, 64 and 256 (benchmarks/README.md).
PACKING_ROWS_HINT = 64
# Up to this many rows a bfloat16 layer in the 64-wide AVX-512 layout multiplies on
# vmesh/kernels/cpu/batch_linear_bf16.c rather than oneDNN, where it measured faster
# (benchmarks/README.md, "bfloat16 products of a few dozen rows").
BATCH_BF16_MAX_ROWS = 32
# The packed layouts the small-batch kernel reads: output features in blocks of this many (float32),
# or of one of these (bfloat16).
PACKED_OUT_BLOCK = 64
BF16_OUT_BLOCKS = (64, 32)
# The load-time layout check compares this many bytes of weight at a time, at most.
LAYOUT_CHECK_CHUNK_BYTES = 16 << 20


def onednn_packing_usable(weight: torch.Tensor) -> bool:
    """oneDNN reorders float32 weights on any x86 CPU; bfloat16 ones only with AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, which torch's AVX-512 capability stands for here (elsewhere the
    product runs through F.linear, as torch's own bfloat16 linears do)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype == torch.float32 or torch.cpu._is_avx512_supported()))


def packed_buffer(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The raw buffer behind an opaque oneDNN tensor, as a flat `dtype` tensor sharing its memory
    (valid while `packed` lives)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


@dataclass(frozen=True)
class PackedLayout:
    """How oneDNN laid out one packed weight, where the small-batch kernel can read it: blocks of
    `out_block` output features, each a row-major [padded_in, out_block] array for float32,
    [padded_in / 2, out_block, 2] for bfloat16 (zero padding included)."""

    padded_in: int
    out_block: int


def packed_layout(weight: torch.Tensor, packed: torch.Tensor) -> PackedLayout | None:
    """The layout of oneDNN's packed copy of `weight`, if it is one the small-batch kernel reads,
    else None."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not all(
            hasattr(torch.ops.mkldnn, op) for op in ("data_ptr", "_nbytes")):
        return None
    return layout_of(weight, packed_buffer(packed, weight.dtype))


def layout_of(weight: torch.Tensor, raw: torch.Tensor) -> PackedLayout | None:
    """Which readable layout the flat buffer `raw` holds `weight` in (see PackedLayout), or None.
    float32 blocks are 64 features wide (OI16i64o, AVX-512); bfloat16 ones 64 (AB16b64a2b,
    AVX-512) or 32 (AB16b32a2b, AMX). Compared value by value: oneDNN documents no layout, and a
    wrong guess would be wrong output."""
    widths = (PACKED_OUT_BLOCK,) if weight.dtype == torch.float32 else BF16_OUT_BLOCKS
    out_features, in_features = weight.shape
    for out_block in widths:
        blocks = -(-out_features // out_block)
        if raw.numel() % (blocks * out_block):
            continue
        padded_in = raw.numel() // (blocks * out_block)
        if padded_in < in_features or (weight.dtype == torch.bfloat16 and padded_in % 2):
            continue
        layout = PackedLayout(padded_in, out_block)
        if _holds(block_view(raw, weight.dtype, layout), weight, out_block):
            return layout
    return None


def _holds(raw: torch.Tensor, weight: torch.Tensor, out_block: int) -> bool:
    # Whole blocks a chunk at a time, the last (partial) block alone: no transient copy of a whole
    # weight, and few comparisons (each one may wake torch's thread pool: a loaded machine took
    # seconds over the 768 blocks of a 49,152-row LM head compared one by one).
    out_features = weight.shape[0]
    block_bytes = raw[0].numel() * weight.element_size()
    whole_blocks = out_features // out_block
    per_chunk = max(1, LAYOUT_CHECK_CHUNK_BYTES // block_bytes)
    chunks = [(first, min(whole_blocks, first + per_chunk)) for first in range(0, whole_blocks, per_chunk)]
    if whole_blocks < raw.shape[0]:
        chunks.append((whole_blocks, raw.shape[0]))
    return all(_blocks_hold(raw[first:end], weight[first * out_block:end * out_block], out_block)
               for first, end in chunks)


def _blocks_hold(raw: torch.Tensor, rows: torch.Tensor, out_block: int) -> bool:
    """Whether `raw` (consecutive packed blocks) holds `rows` (their output features' weight rows;
    all of each block, or fewer in the one last block)."""
    count, in_features = rows.shape
    blocks = raw.shape[0]
    width = min(count, out_block)  # features per block: all, or the last block's remainder
    if rows.dtype == torch.float32:
        return torch.equal(raw[:, :in_features, :width], rows.reshape(blocks, width, in_features).transpose(1, 2))
    padded_in = raw.shape[1] * 2
    padded = torch.zeros(count, padded_in, dtype=rows.dtype)
    padded[:, :in_features] = rows
    return torch.equal(raw[:, :, :width], padded.view(blocks, width, padded_in // 2, 2).transpose(1, 2))


def block_view(raw: torch.Tensor, dtype: torch.dtype, layout: PackedLayout) -> torch.Tensor:
    """A flat packed buffer as its blocks: [blocks, padded_in, out_block] (float32) or
    [blocks, padded_in / 2, out_block, 2] (bfloat16)."""
    if dtype == torch.float32:
        return raw.view(-1, layout.padded_in, layout.out_block)
    return raw.view(-1, layout.padded_in // 2, layout.out_block, 2)


class Linear:
    """y = x @ weight.T + bias, for x of any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 small_batch_kernels: CpuKernels | None = None):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = bias.contiguous() if bias is not None else None
        # Kept only while no other representation serves every row count.
        self.weight: torch.Tensor | None = weight.contiguous()
        self._small_batch = (small_batch_kernels if weight.dtype in (torch.float32, torch.bfloat16)
                             and weight.device.type == "cpu" else None)
        self._packed: torch.Tensor | None = None
        self._packed_address = 0
        self._layout: PackedLayout | None = None
        if pack and onednn_packing_usable(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACKING_ROWS_HINT)
            except RuntimeError as exc:  # an unusual torch build: fall back, loudly
                logger.warning("oneDNN weight packing failed (%s); using F.linear", exc)
        # block_view of the packed copy, where its layout is one the small-batch kernel reads.
        self._packed_blocks: torch.Tensor | None = None
        if self._packed is not None:
            self._layout = packed_layout(self.weight, self._packed)
            if self._layout is not None:
                self._packed_address = torch.ops.mkldnn.data_ptr(self._packed)
                self._packed_blocks = block_view(packed_buffer(self._packed, weight.dtype), weight.dtype, self._layout)
        # The batch kernel reads the 64-wide layout oneDNN picks on AVX-512 without AMX (with AMX,
        # its 32-wide one, oneDNN's own tile products are far faster).
        self._batch_bf16 = (self._small_batch is not None and self._small_batch.bf16_dot and self._layout is not None
                            and weight.dtype == torch.bfloat16 and self._layout.out_block == PACKED_OUT_BLOCK)
        if self._packed_blocks is None and weight.dtype == torch.bfloat16:
            self._small_batch = None  # oneDNN then serves a few rows too: no plain bfloat16 copy is kept for them
        if self._packed is not None and (self._small_batch is None or self._packed_blocks is not None):
            self.weight = None  # the packed copy serves every row count

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def kernel_description(self) -> str:
        """What multiplies by this weight, for the load-time log."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self._packed is None:
            return f"F.linear {dtype}"
        if self._batch_bf16:
            assert self._small_batch is not None, "set with the batch kernel"
            return (f"oneDNN {dtype} packed, 1-{self._small_batch.stream_rows} rows C, "
                    f"to {BATCH_BF16_MAX_ROWS} rows C (AVX-512 BF16)")
        if self._small_batch is not None:
            return f"oneDNN {dtype} packed, 1-{self._small_batch.stream_rows} rows C"
        return f"oneDNN {dtype} packed"

    @property
    def rows_readable(self) -> bool:
        """Whether `weight_rows` can answer: a tied embedding then needs no table of its own."""
        return self.weight is not None or self._packed_blocks is not None

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids] for 1-D ids, from whichever representation is held: the lookup of an
        embedding table tied to this layer. From the packed copy each row is a strided gather
        (one cache line per feature), negligible beside the layers a token then goes through."""
        if self.weight is not None:
            return self.weight[ids]
        if self._packed_blocks is None:
            raise RuntimeError("this layer holds its weight in an unknown packed layout only")
        width = self._packed_blocks.shape[2]  # the layout's out_block
        if self.dtype == torch.bfloat16:
            pairs = self._packed_blocks[ids // width, :, ids % width]  # [n, padded_in / 2, 2]
            return pairs.reshape(len(ids), -1)[:, :self.in_features]
        return self._packed_blocks[ids // width, :self.in_features, ids % width]

    def held_bytes(self) -> dict[str, int]:
        """Bytes this layer holds per representation of its weight (its bias aside)."""
        held: dict[str, int] = {}
        if self._packed is not None:
            held["packed"] = torch.ops.mkldnn._nbytes(self._packed)
        if self.weight is not None:
            held["plain"] = self.weight.nbytes
        return held

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        # The streaming kernel, where it serves this many rows.
        stream = self._small_batch
        if stream is not None and x.shape[0] > stream.stream_rows:
            stream = None
        if (stream is not None and self.dtype == torch.bfloat16
                and x.dtype in (torch.bfloat16, torch.float32)):
            # x may be float32 (attention's output in the mixed bfloat16 model): the kernel widens either.
            assert self._layout is not None, "bfloat16 layers keep the kernel only over a checked layout"
            out = stream.packed_small_batch_linear(x.contiguous(), self._packed_address, self.out_features,
                                                   self._layout.padded_in, self.bias, dtype=torch.bfloat16,
                                                   out_block=self._layout.out_block)
            return out.view(*lead, self.out_features)
        if self._batch_bf16 and x.shape[0] <= BATCH_BF16_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float32):
            assert self._small_batch is not None and self._layout is not None, "set with the batch kernel"
            out = self._small_batch.packed_batch_linear_bf16(x.contiguous(), self._packed_address, self.out_features,
                                                             self._layout.padded_in, self.bias)
            return out.view(*lead, self.out_features)
        # The mixed bfloat16 model hands some layers float32 (attention's output): one rounding here.
        x = x.to(self.dtype)
        if stream is not None and x.dtype == torch.float32:
            if self._packed_blocks is not None:
                assert self._layout is not None, "set with the packed blocks"
                out = stream.packed_small_batch_linear(x.contiguous(), self._packed_address, self.out_features,
                                                       self._layout.padded_in, self.bias)
            else:
                assert self.weight is not None, "without a readable packed copy the plain weight stays"
                out = stream.small_batch_linear(x.contiguous(), self.weight, self.bias)
        elif self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        else:
            assert self.weight is not None, "a layer without a packed copy keeps its plain weight"
            out = F.linear(x, self.weight, self.bias)
        return out.view(*lead, self.out_features)
