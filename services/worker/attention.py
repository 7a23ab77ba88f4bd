"""Attention over a paged KV cache: the per-step metadata and the backend interface.

The model never sees batching details beyond `AttentionMetadata`; a backend writes the
step's new keys/values into the block pool through the slot mapping, then attends each
query token to its request's context through the request's block table.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vmesh.kernels.cpu_checks import cache_head_dim
from vmesh.kernels.reference import cache_as, write_kv_ref
from vmesh.services.common.model_loading import cache_dir_path

if TYPE_CHECKING:
    from vmesh.kernels.cpu_checks import AttentionItems, PrefillChunks

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token; -1 = skip
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    # Host copies, so backends can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Whatever a backend derives from this metadata once per step and reuses in every layer.
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]."""

    @abstractmethod
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """query: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. window: a sliding
        window (a query at position p sees p - window + 1 ..= p); None: every earlier position.
        Over a bfloat16 cache (the mixed bfloat16 model) a float32 query must hold bfloat16 values,
        as the model's rotated queries do: the C prefill kernel multiplies it in bfloat16 pairs."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend for CPU: single-token queries (decodes) are batched into one padded
    attention; longer queries (prefill chunks) each get one causal attention call."""

    name = "torch"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping):
        if key_cache.dtype != torch.int8:  # an 8-bit cache quantizes the rows as they are
            key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query, key_cache, value_cache, meta, scale, window=None):
        out = torch.empty_like(query)
        if "decodes" not in meta.backend_cache:
            meta.backend_cache["decodes"] = self._find_decodes(meta)
        decodes = meta.backend_cache["decodes"]
        if decodes is not None:
            self._attend_decodes(query, key_cache, value_cache, meta, scale, decodes, out, window)
        if decodes is None or len(decodes[0]) < meta.num_reqs:
            starts = meta.query_start_loc.tolist()
            for i, n in enumerate(meta.query_lens_cpu):
                if n > 1:
                    s = starts[i]
                    out[s:s + n] = self._attend_chunk(query[s:s + n], key_cache, value_cache,
                                                      meta.block_tables[i], meta.seq_lens_cpu[i], scale, window)
        return out

    @staticmethod
    def _find_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(request rows, their query token rows) of the single-token queries, or None."""
        rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if not rows:
            return None
        rows_t = torch.tensor(rows, dtype=torch.long, device=meta.seq_lens.device)
        return rows_t, meta.query_start_loc[rows_t].long()

    @staticmethod
    def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
                        dtype: torch.dtype) -> torch.Tensor:
        # [..., num_blocks] block ids -> [..., kv_heads, num_blocks * block_size, head_dim], in the
        # query's dtype (float32 over the mixed bfloat16 model's cache; an 8-bit cache dequantized)
        blocks = cache_as(cache[block_table[..., :num_blocks].long()], dtype)
        lead = blocks.shape[:-4]
        blocks = blocks.reshape(*lead, num_blocks * cache.shape[1], cache.shape[2], blocks.shape[-1])
        return blocks.transpose(-3, -2)

    @staticmethod
    def _plan_padded(meta: AttentionMetadata, rows: torch.Tensor, block_size: int, window: int | None):
        longest = max(seq for seq, n in zip(meta.seq_lens_cpu, meta.query_lens_cpu) if n == 1)  # host, no sync
        num_blocks = -(-longest // block_size)
        positions = torch.arange(num_blocks * block_size, device=meta.seq_lens.device)
        seq_lens = meta.seq_lens[rows].to(positions.dtype)[:, None]
        visible = positions[None, :] < seq_lens
        if window is not None:  # the query sits at seq_len - 1
            visible &= positions[None, :] >= seq_lens - window
        return meta.block_tables[rows], num_blocks, visible[:, None, None, :]

    def _attend_decodes(self, query, key_cache, value_cache, meta, scale, decodes, out, window=None):
        """All single-token queries at once: their contexts gathered into one padded batch."""
        rows, token_index = decodes
        if ("padded", window) not in meta.backend_cache:
            meta.backend_cache["padded", window] = self._plan_padded(meta, rows, key_cache.shape[1], window)
        tables, num_blocks, mask = meta.backend_cache["padded", window]
        head_dim = cache_head_dim(key_cache)
        keys = self._gather_context(key_cache, tables, num_blocks, query.dtype)  # [B, kvh, L, d]
        values = self._gather_context(value_cache, tables, num_blocks, query.dtype)
        # The query heads sharing one KV head become that head's "query length" (GQA).
        q = query[token_index].view(len(rows), key_cache.shape[2], -1, head_dim)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out[token_index] = attn.reshape(len(rows), -1, head_dim)

    def _attend_chunk(self, query, key_cache, value_cache, block_table, seq_len, scale, window=None):
        n, heads, _ = query.shape
        num_blocks = -(-seq_len // key_cache.shape[1])
        keys = self._gather_context(key_cache, block_table, num_blocks, query.dtype)[:, :seq_len]
        values = self._gather_context(value_cache, block_table, num_blocks, query.dtype)[:, :seq_len]
        q = query.transpose(0, 1)  # [heads, n, d]
        kv_heads = keys.shape[0]
        if kv_heads != heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=0)
            values = values.repeat_interleave(heads // kv_heads, dim=0)
        if n == seq_len and window is None:
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        else:  # the chunk starts after cached tokens: query j sits at position seq_len - n + j
            q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos[:, None]
            if window is not None:
                mask &= k_pos > q_pos[:, None] - window
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return attn.transpose(0, 1)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend, with attention answered by C kernels that read the paged pool in
    place (`vmesh/kernels/cpu`): no padded copy of every context in every layer.

    Decodes go to the per-token kernel (each cached key and value read once per query
    token); prefill chunks, whatever their length or cached context, to the tiled kernel,
    which reads each key and value once per tile of query tokens and computes the scores and
    the weighted values as register-blocked matrix products (timings in benchmarks/README.md,
    "Prefill attention"). Both take a float32, a bfloat16 or an 8-bit cache (float32 queries,
    bfloat16-valued over a bfloat16 cache, and float32 sums; vmesh/kernels/cpu/kv_int8.h).
    The plan is built once per step from the host copies, in work that grows with the number
    of requests, not with their lengths."""

    name = "cpu"

    def __init__(self, cache_dir: Path | None = None) -> None:
        from vmesh.kernels.cpu_native import load_cpu_kernels

        self.kernels = load_cpu_kernels(cache_dir_path(cache_dir))

    def attend(self, query, key_cache, value_cache, meta, scale, window=None):
        if not self.kernels.supports(query, key_cache):
            return super().attend(query, key_cache, value_cache, meta, scale, window)
        items, chunks = self.step_plan(meta, key_cache)  # built by the first layer's call
        out = torch.empty_like(query)
        if items is not None:
            self.kernels.paged_attention(query, key_cache, value_cache, items, scale, out, window)
        if chunks is not None:
            self.kernels.prefill_attention(query, key_cache, value_cache, chunks, scale, out, window)
        return out

    def step_plan(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> tuple[AttentionItems | None,
                                                                                 PrefillChunks | None]:
        """(the per-token kernel's items, the tiled kernel's chunks) of this step, either None: built
        by the first layer's call, reused by the others'."""
        if "cpu_plan" not in meta.backend_cache:
            meta.backend_cache["cpu_plan"] = self._plan(meta, tiled=self.kernels.supports_prefill(key_cache))
        return meta.backend_cache["cpu_plan"]

    def _plan(self, meta: AttentionMetadata, tiled: bool):
        """(the per-token kernel's items, the tiled kernel's chunks); either may be None."""
        query_lens = torch.tensor(meta.query_lens_cpu)
        ends = torch.cumsum(query_lens, 0)
        seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)
        chunk_rows = torch.nonzero(query_lens > 1).flatten() if tiled else torch.empty(0, dtype=torch.long)
        chunks = None
        if len(chunk_rows):
            lengths = query_lens[chunk_rows]
            chunks = self.kernels.prefill_chunks(meta.block_tables, chunk_rows, ends[chunk_rows] - lengths,
                                                 lengths.to(torch.int32), seq_lens[chunk_rows])
        if tiled:  # decodes only: one item each
            request_rows = torch.nonzero(query_lens == 1).flatten()
            if not len(request_rows):
                return None, chunks
            token_rows = ends[request_rows] - 1
            context_lens = seq_lens[request_rows]
        else:  # every query token is an item; token t sees the context up to its own position
            request_rows = torch.repeat_interleave(torch.arange(meta.num_reqs), query_lens)
            token_rows = torch.arange(int(ends[-1]))
            context_lens = (seq_lens[request_rows] - (ends[request_rows] - 1 - token_rows)).to(torch.int32)
        return self.kernels.attention_items(meta.block_tables, request_rows, token_rows, context_lens), chunks


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels of `vmesh/kernels/`: one unified kernel for any ragged batch, and a
    split-KV path for decode-only batches too small to fill the device."""

    name = "triton"
    # Split the context of decode-only batches into segments when there are fewer
    # (request, KV head) pairs than this, and contexts are long.
    SPLIT_BELOW_PROGRAMS = 256
    SPLIT_MIN_CONTEXT = 1024
    TOKENS_PER_SPLIT = 512
    MAX_SPLITS = 16

    def __init__(self) -> None:
        from vmesh.kernels.kv_cache_write import write_kv
        from vmesh.kernels.paged_attention import split_kv_decode_attention, unified_attention

        self._write_kv, self._unified, self._split = write_kv, unified_attention, split_kv_decode_attention

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping):
        self._write_kv(key, value, key_cache, value_cache, slot_mapping)

    def num_splits(self, meta: AttentionMetadata, kv_heads: int, window: int | None = None) -> int:
        """1 (the unified kernel) under a sliding window too: the window bounds the context the
        split path exists for."""
        if (max(meta.query_lens_cpu) != 1 or meta.num_reqs * kv_heads >= self.SPLIT_BELOW_PROGRAMS
                or window is not None):
            return 1
        longest = max(meta.seq_lens_cpu)
        if longest < self.SPLIT_MIN_CONTEXT:
            return 1
        return min(self.MAX_SPLITS, -(-longest // self.TOKENS_PER_SPLIT))

    def attend(self, query, key_cache, value_cache, meta, scale, window=None):
        splits = self.num_splits(meta, key_cache.shape[2], window)
        if splits > 1:
            return self._split(query, key_cache, value_cache, meta.seq_lens, meta.block_tables, scale, splits)
        return self._unified(query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             scale, max_query_len=max(meta.query_lens_cpu), window=window)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend,
                                                         "triton": TritonAttentionBackend}


def triton_usable(device: torch.device) -> bool:
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_attention_backend(name: str, device: torch.device, cache_dir: Path | None = None) -> AttentionBackend:
    """`auto`: Triton on CUDA; on CPU the C attention kernels, or plain torch where they cannot be built."""
    from vmesh.kernels.cpu_native import CpuKernelBuildError

    if name == "auto":
        if device.type == "cuda" and triton_usable(device):
            return TritonAttentionBackend()
        if device.type != "cpu":
            return TorchAttentionBackend()
        try:
            return CpuAttentionBackend(cache_dir)
        except CpuKernelBuildError as exc:
            logger.warning("CPU attention kernel unavailable (%s); decode attention uses the slower torch path", exc)
            return TorchAttentionBackend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available (available: {sorted(ATTENTION_BACKENDS)})")
    if name == "triton" and not triton_usable(device):
        raise ValueError("the triton attention backend needs triton and a CUDA device "
                         "(or TRITON_INTERPRET=1 for testing on CPU)")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not on {device}")
        return CpuAttentionBackend(cache_dir)
    return ATTENTION_BACKENDS[name]()
