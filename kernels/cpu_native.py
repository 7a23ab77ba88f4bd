"""CPU kernels in C (`kernels/cpu/*.c`), compiled on first use with the machine's C compiler
and loaded with ctypes.

The shared object is cached under `<cache_dir>/kernels/`, keyed by a hash of the sources,
the compiler's version and the flags, and written to a temporary name first, so processes
starting at once never load a half-written file. Without a compiler the callers keep their
pure-torch path; `load_cpu_kernels` says why in its error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "cpu"
SOURCES = sorted(KERNEL_DIR.glob("*.c"))
HEADERS = sorted(KERNEL_DIR.glob("*.h"))
# -march=native: the object is built on the machine that runs it, and cached per machine.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
MAX_HEADS, MAX_HEAD_DIM = 256, 256  # as in the C source
# The attention kernels' cache element types (float32 arithmetic either way).
KV_DTYPES = (torch.float32, torch.bfloat16)


class CpuKernelBuildError(RuntimeError):
    pass


def _compiler() -> str:
    requested = os.environ.get("CC")
    compiler = shutil.which(requested) if requested else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise CpuKernelBuildError(f"C compiler {requested!r} (from CC) not found" if requested
                                  else "no C compiler found (install gcc, or set CC)")
    return compiler


def _build(cache_dir: Path) -> Path:
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    # -march=native differs by CPU; a cache dir shared between machines must not mix them.
    cpuinfo = Path("/proc/cpuinfo").read_bytes() if Path("/proc/cpuinfo").exists() else b""
    flags_line = next((line for line in cpuinfo.splitlines() if line.startswith(b"flags")), b"")
    sources = b"".join(path.name.encode() + path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(sources + version.encode() + " ".join(CFLAGS).encode() + flags_line).hexdigest()
    target = cache_dir / "kernels" / f"vmesh-cpu-kernels-{key[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CpuKernelBuildError(f"{compiler} failed on kernels/cpu:\n{result.stderr.strip()}")
        os.replace(built, target)
    logger.info("built CPU kernels: %s", target)
    return target


class CpuKernels:
    def __init__(self, library: ctypes.CDLL):
        p, i64, f32, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._attention = _bind(library.paged_attention_f32,
                             [p, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, p, threads], ctypes.c_int)
        self._prefill_attention = _bind(library.prefill_attention_f32,
                                        [p, i64, p, p, p, i64, p, p, p, p, i64, i64, i64, i64, i64, f32, p, threads],
                                        ctypes.c_int)
        self._small_batch_linear = _bind(library.small_batch_linear_f32, [p, p, p, p, i64, i64, i64, threads])
        self._packed_small_batch_linear = _bind(library.packed_small_batch_linear_f32,
                                                [p, p, p, p, i64, i64, i64, i64, threads], ctypes.c_int)
        self._add_rms_norm = _bind(library.add_rms_norm_f32, [p, p, p, p, i64, i64, f32, threads])
        self._silu_and_mul = _bind(library.silu_and_mul_f32, [p, p, i64, i64, threads])
        self._rotary_write_kv = _bind(library.rotary_write_kv_f32,
                                      [p, i64, i64, i64, i64, i64, p, p, p, p, p, threads])
        # The bfloat16 model's variants (fused_ops.c): bfloat16 activations and KV cache around a
        # float32 residual stream; the attention kernels over a bfloat16 cache, float32 otherwise.
        self._attention_bf16 = _bind(library.paged_attention_bf16,
                                     [p, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, p, threads],
                                     ctypes.c_int)
        self._prefill_attention_bf16 = _bind(library.prefill_attention_bf16,
                                             [p, i64, p, p, p, i64, p, p, p, p, i64, i64, i64, i64, i64, f32, p,
                                              threads], ctypes.c_int)
        self._packed_small_batch_linear_bf16 = _bind(library.packed_small_batch_linear_bf16,
                                                     [p, ctypes.c_int, p, p, p, i64, i64, i64, i64, threads],
                                                     ctypes.c_int)
        self._add_rms_norm_bf16 = _bind(library.add_rms_norm_bf16, [p, p, p, p, i64, i64, f32, threads])
        self._silu_and_mul_bf16 = _bind(library.silu_and_mul_bf16, [p, p, i64, i64, threads])
        self._rotary_write_kv_bf16 = _bind(library.rotary_write_kv_bf16,
                                           [p, i64, i64, i64, i64, i64, p, p, p, p, p, p, threads])
        self._quantized_linear = _bind(library.quantized_linear_f32, [p, p, ctypes.c_int, p, p, i64, i64, i64, threads],
                                       ctypes.c_int)
        self._quantized_rows = _bind(library.quantized_rows_f32, [p, ctypes.c_int, p, i64, i64, i64, p, threads],
                                     ctypes.c_int)

    # The elementwise ops below run 3-4 times per layer: they check only dtype and layout,
    # which is what a wrong pointer would corrupt memory through.

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """vmesh.kernels.reference.rms_norm_ref's contract for 2-D float32 x, except that `residual`
        is updated in place to x + residual (and returned) rather than copied."""
        if x.dim() != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"x must be [rows, dim] with a weight of [dim], got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
        if residual is None:
            _require_contiguous_cpu(("x", x, torch.float32), ("weight", weight, torch.float32))
            out = torch.empty_like(x)
            self._add_rms_norm(0, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                               torch.get_num_threads())
            return out
        _require_contiguous_cpu(("x", x, torch.float32), ("residual", residual, torch.float32),
                                ("weight", weight, torch.float32))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                           x.shape[1], eps, torch.get_num_threads())
        return out, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, up) -> silu(gate) * up, as kernels.reference.silu_and_mul_ref."""
        _require_contiguous_cpu(("gate_up", gate_up, torch.float32))
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [rows, 2 * inter], got {tuple(gate_up.shape)}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rotary_write_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) * head_dim], rows contiguous: rotates queries and
        keys in place (RotaryEmbedding.apply), writes keys and values to the caches at
        slot_mapping (-1: skipped) and returns the queries, a [tokens, heads, head_dim] view.
        cos, sin: [tokens, head_dim] (or [tokens, 1, head_dim]) rows for the tokens' positions."""
        head_dim = key_cache.shape[3]
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"qkv must be float32 [tokens, {(heads + 2 * kv_heads) * head_dim}] with contiguous rows")
        if key_cache.shape[2] != kv_heads or value_cache.shape != key_cache.shape or head_dim % 2:
            raise ValueError(f"caches of shape {tuple(key_cache.shape)} do not fit {kv_heads} KV heads")
        _require_contiguous_cpu(("cos", cos, torch.float32), ("sin", sin, torch.float32),
                                ("key_cache", key_cache, torch.float32), ("value_cache", value_cache, torch.float32),
                                ("slot_mapping", slot_mapping, torch.int64))
        tokens = qkv.shape[0]
        if cos.numel() != tokens * head_dim or sin.numel() != tokens * head_dim or slot_mapping.numel() != tokens:
            raise ValueError("cos, sin and slot_mapping need one row per token")
        self._rotary_write_kv(qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, head_dim, cos.data_ptr(),
                              sin.data_ptr(), slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                              torch.get_num_threads())
        return qkv[:, :heads * head_dim].view(tokens, heads, head_dim)

    def add_rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm for the bfloat16 model: the output is bfloat16, the residual stream and the
        weight float32. Without `residual`, x is that float32 stream (left as it is); with it, x is
        a linear's bfloat16 output, added to `residual` in place."""
        if x.dim() != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"x must be [rows, dim] with a weight of [dim], got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        if residual is None:
            _require_contiguous_cpu(("x", x, torch.float32), ("weight", weight, torch.float32))
            self._add_rms_norm_bf16(0, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                    torch.get_num_threads())
            return out
        _require_contiguous_cpu(("x", x, torch.bfloat16), ("residual", residual, torch.float32),
                                ("weight", weight, torch.float32))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        self._add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                                x.shape[1], eps, torch.get_num_threads())
        return out, residual

    def silu_and_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu_and_mul in bfloat16, computed in float32 and rounded once."""
        _require_contiguous_cpu(("gate_up", gate_up, torch.bfloat16))
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [rows, 2 * inter], got {tuple(gate_up.shape)}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        self._silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rotary_write_kv_bf16(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                             sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> torch.Tensor:
        """rotary_write_kv for the bfloat16 model: qkv and the caches bfloat16, cos and sin float32.
        qkv is left as it is; the rotated queries come back as a new float32 [tokens, heads, head_dim]
        tensor (attention runs in float32), the rotated keys are rounded into the cache."""
        head_dim = key_cache.shape[3]
        if qkv.dtype != torch.bfloat16 or qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"qkv must be bfloat16 [tokens, {(heads + 2 * kv_heads) * head_dim}] with contiguous "
                             "rows")
        if key_cache.shape[2] != kv_heads or value_cache.shape != key_cache.shape or head_dim % 2:
            raise ValueError(f"caches of shape {tuple(key_cache.shape)} do not fit {kv_heads} KV heads")
        _require_contiguous_cpu(("cos", cos, torch.float32), ("sin", sin, torch.float32),
                                ("key_cache", key_cache, torch.bfloat16), ("value_cache", value_cache, torch.bfloat16),
                                ("slot_mapping", slot_mapping, torch.int64))
        tokens = qkv.shape[0]
        if cos.numel() != tokens * head_dim or sin.numel() != tokens * head_dim or slot_mapping.numel() != tokens:
            raise ValueError("cos, sin and slot_mapping need one row per token")
        query = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
        self._rotary_write_kv_bf16(qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, head_dim, cos.data_ptr(),
                                   sin.data_ptr(), slot_mapping.data_ptr(), key_cache.data_ptr(),
                                   value_cache.data_ptr(), query.data_ptr(), torch.get_num_threads())
        return query

    def small_batch_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ weight.T + bias for a few rows (memory bound: one pass over weight).
        Every tensor must be contiguous float32 on the CPU; the caller (Linear) guarantees it."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._small_batch_linear(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                 out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                                 torch.get_num_threads())
        return out

    def packed_small_batch_linear(self, x: torch.Tensor, packed_weight_address: int, out_features: int,
                                  padded_in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """small_batch_linear over oneDNN's packed copy of the weight, at its raw address, in the
        OI16i64o layout that services/worker/linear.py checked at load (see small_batch_linear.c).
        x: contiguous float32 [1 to 4 rows, in]; the caller (Linear) guarantees it."""
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        status = self._packed_small_batch_linear(x.data_ptr(), packed_weight_address,
                                                 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                                 out_features, x.shape[1], padded_in_features, torch.get_num_threads())
        if status:
            raise ValueError(f"packed_small_batch_linear_f32: {x.shape[0]} rows of {x.shape[1]} features do not fit "
                             f"a packed weight of {padded_in_features} input features")
        return out

    def packed_small_batch_linear_bf16(self, x: torch.Tensor, packed_weight_address: int, out_features: int,
                                       padded_in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """packed_small_batch_linear over oneDNN's packed bfloat16 weight (AB16b64a2b, checked at load
        by services/worker/linear.py): x contiguous bfloat16 or float32 [1 to 4 rows, in], bias
        bfloat16 or None; the result is bfloat16. The caller (Linear) guarantees the layouts."""
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)
                                 or not bias.is_contiguous()):  # read through a raw pointer as bfloat16
            raise ValueError(f"packed_small_batch_linear_bf16: bias must be contiguous bfloat16 [{out_features}], "
                             f"got {bias.dtype} {tuple(bias.shape)}")
        out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
        status = self._packed_small_batch_linear_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16),
                                                      packed_weight_address, 0 if bias is None else bias.data_ptr(),
                                                      out.data_ptr(), x.shape[0], out_features, x.shape[1],
                                                      padded_in_features, torch.get_num_threads())
        if status == 2:
            raise MemoryError("packed_small_batch_linear_bf16: out of memory")
        if status:
            raise ValueError(f"packed_small_batch_linear_bf16: {x.shape[0]} rows of {x.shape[1]} features do not "
                             f"fit a packed weight of {padded_in_features} input features")
        return out

    def quantized_linear(self, x: torch.Tensor, blocks: torch.Tensor, block_format: int, in_features: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ W.T + bias with W [out, in] held as GGUF blocks: `blocks` is uint8
        [out, in / 32 * block bytes] in `block_format` (a GGML type id: 2 Q4_0, 3 Q4_1, 8 Q8_0; see
        kernels/cpu/quantized_linear.c). Checked here: the call reads raw pointers."""
        _require_quantized(blocks, block_format, in_features)
        _require_contiguous_cpu(("x", x, torch.float32))
        if x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
        out_features = blocks.shape[0]
        if bias is not None:
            _require_contiguous_cpu(("bias", bias, torch.float32))
            if bias.shape != (out_features,):
                raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        status = self._quantized_linear(x.data_ptr(), blocks.data_ptr(), block_format,
                                        0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                        out_features, in_features, torch.get_num_threads())
        if status == 2:
            raise MemoryError("quantized_linear_f32: out of memory for its weight tiles")
        if status:
            raise ValueError(f"quantized_linear_f32 refused {x.shape[0]} rows of {in_features} features")
        return out

    def quantized_rows(self, blocks: torch.Tensor, block_format: int, in_features: int,
                       ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` (1-D int64) of a weight held as GGUF blocks (see quantized_linear)."""
        _require_quantized(blocks, block_format, in_features)
        _require_contiguous_cpu(("ids", ids, torch.int64))
        out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
        if self._quantized_rows(blocks.data_ptr(), block_format, ids.data_ptr(), ids.numel(), blocks.shape[0],
                                in_features, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"ids must lie in [0, {blocks.shape[0]})")
        return out

    @staticmethod
    def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """float32 queries over a float32 or bfloat16 cache, in the kernels' size limits."""
        return (query.device.type == "cpu" and query.dtype == torch.float32 and key_cache.dtype in KV_DTYPES
                and query.shape[1] <= MAX_HEADS and key_cache.shape[3] <= MAX_HEAD_DIM)

    @staticmethod
    def supports_prefill(key_cache: torch.Tensor) -> bool:
        """Whether prefill_attention takes this cache's head size (the per-token kernel takes any)."""
        return key_cache.shape[3] % 16 == 0

    @staticmethod
    def attention_items(block_tables: torch.Tensor, request_rows: torch.Tensor, token_rows: torch.Tensor,
                        context_lens: torch.Tensor) -> AttentionItems:
        """Checked once per step; every layer's call reuses it."""
        _require_contiguous_cpu(("block_tables", block_tables, torch.int32),
                                ("request_rows", request_rows, torch.int64), ("token_rows", token_rows, torch.int64),
                                ("context_lens", context_lens, torch.int32))
        if not request_rows.numel() == token_rows.numel() == context_lens.numel():
            raise ValueError("request_rows, token_rows and context_lens need one entry per query token")
        return AttentionItems(block_tables, request_rows, token_rows, context_lens,
                              *_reach(block_tables, request_rows, token_rows + 1, context_lens))

    @staticmethod
    def prefill_chunks(block_tables: torch.Tensor, requests: torch.Tensor, starts: torch.Tensor,
                       lengths: torch.Tensor, seq_lens: torch.Tensor) -> PrefillChunks:
        """Checked once per step; every layer's call reuses it."""
        _require_contiguous_cpu(("block_tables", block_tables, torch.int32), ("requests", requests, torch.int64),
                                ("starts", starts, torch.int64), ("lengths", lengths, torch.int32),
                                ("seq_lens", seq_lens, torch.int32))
        if not requests.numel() == starts.numel() == lengths.numel() == seq_lens.numel():
            raise ValueError("requests, starts, lengths and seq_lens need one entry per chunk")
        if bool((lengths < 1).any()) or bool((seq_lens < lengths).any()):
            raise ValueError("every chunk needs 1 <= length <= seq_len")
        return PrefillChunks(block_tables, requests, starts, lengths, seq_lens,
                             *_reach(block_tables, requests, starts + lengths, seq_lens))

    def prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          chunks: PrefillChunks, scale: float, out: torch.Tensor) -> None:
        """For each chunk, causal attention of its query rows over its request's cached context
        (the chunk's own keys included), written to the same rows of out. Shapes and layouts:
        see kernels/cpu/prefill_attention.c; head_dim must be a multiple of 16. The caches may be
        bfloat16 (the query and out stay float32)."""
        block_size, kv_heads, head_dim, group = _attention_shape(query, key_cache, value_cache, out, chunks)
        kernel = self._prefill_attention if key_cache.dtype == torch.float32 else self._prefill_attention_bf16
        status = kernel(query.data_ptr(), query.stride(0), key_cache.data_ptr(),
                                         value_cache.data_ptr(), chunks.block_tables.data_ptr(),
                                         chunks.block_tables.shape[1], chunks.requests.data_ptr(),
                                         chunks.starts.data_ptr(), chunks.lengths.data_ptr(),
                                         chunks.seq_lens.data_ptr(), chunks.requests.numel(), kv_heads, group,
                                         head_dim, block_size, scale, out.data_ptr(), torch.get_num_threads())
        if status == 1:
            raise ValueError(f"unsupported prefill attention shape: group {group}, head_dim {head_dim}")
        if status == 2:
            raise MemoryError("prefill_attention: out of memory for its tiles")

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        items: AttentionItems, scale: float, out: torch.Tensor) -> None:
        """For each item i, writes out[token_rows[i]] = attention of query[token_rows[i]] over the
        first context_lens[i] cached tokens of block_tables[request_rows[i]]. Shapes and
        layouts: see kernels/cpu/paged_attention.c. The caches may be bfloat16 (the query and out
        stay float32)."""
        block_size, kv_heads, head_dim, group = _attention_shape(query, key_cache, value_cache, out, items)
        kernel = self._attention if key_cache.dtype == torch.float32 else self._attention_bf16
        status = kernel(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                                 items.block_tables.data_ptr(), items.block_tables.shape[1],
                                 items.request_rows.data_ptr(), items.token_rows.data_ptr(),
                                 items.context_lens.data_ptr(), items.token_rows.numel(), kv_heads, group, head_dim,
                                 block_size, scale, out.data_ptr(), torch.get_num_threads())
        if status == 1:
            raise ValueError(f"unsupported attention shape: group {group}, head_dim {head_dim}")
        if status == 2:
            raise MemoryError("paged_attention: out of memory for the score buffer")


@dataclass(frozen=True)
class AttentionItems:
    """The query tokens the attention kernel answers this step, one entry each: their row of
    block_tables, their row of the query, and how many cached tokens they see."""

    block_tables: torch.Tensor  # [num_reqs, width] int32
    request_rows: torch.Tensor  # [num_items] int64
    token_rows: torch.Tensor  # [num_items] int64
    context_lens: torch.Tensor  # [num_items] int32
    rows_end: int  # one past the last query row read or written
    longest: int  # the longest context, in tokens


@dataclass(frozen=True)
class PrefillChunks:
    """The prefill chunks the tiled kernel answers this step, one entry each: their row of
    block_tables, their first query row, their length, and their request's context length
    once the chunk is in the cache."""

    block_tables: torch.Tensor  # [num_reqs, width] int32
    requests: torch.Tensor  # [num_chunks] int64
    starts: torch.Tensor  # [num_chunks] int64
    lengths: torch.Tensor  # [num_chunks] int32
    seq_lens: torch.Tensor  # [num_chunks] int32
    rows_end: int  # one past the last query row read or written
    longest: int  # the longest context, in tokens


def _reach(block_tables: torch.Tensor, requests: torch.Tensor, row_ends: torch.Tensor,
           context_lens: torch.Tensor) -> tuple[int, int]:
    """(rows_end, longest) of a step's work, checked against the block table once per step."""
    if not len(requests):
        return 0, 0
    if int(requests.min()) < 0 or int(requests.max()) >= block_tables.shape[0] or int(row_ends.min()) < 1:
        raise ValueError("request rows must index block_tables, and query rows must be >= 0")
    return int(row_ends.max()), int(context_lens.max())


def _attention_shape(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     work: AttentionItems | PrefillChunks) -> tuple[int, int, int, int]:
    """What both attention kernels check before they read raw pointers, in O(1) per layer;
    returns (block_size, kv_heads, head_dim, query heads per KV head)."""
    if query.dim() != 3 or query.dtype != torch.float32 or query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        raise ValueError("query must be float32 [tokens, heads, head_dim] with each token's heads contiguous")
    if key_cache.dtype not in KV_DTYPES:
        raise ValueError(f"the KV cache must be float32 or bfloat16, got {key_cache.dtype}")
    _require_contiguous_cpu(("key_cache", key_cache, key_cache.dtype), ("value_cache", value_cache, key_cache.dtype),
                            ("out", out, torch.float32))
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or out.shape != query.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} and out {tuple(out.shape)} "
                         f"do not fit query {tuple(query.shape)}")
    _, block_size, kv_heads, head_dim = key_cache.shape
    if query.shape[2] != head_dim or query.shape[1] % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit {kv_heads} KV heads of size {head_dim}")
    if work.rows_end > query.shape[0] or work.longest > work.block_tables.shape[1] * block_size:
        raise ValueError(f"the step reaches query row {work.rows_end - 1} and context {work.longest}, beyond "
                         f"{query.shape[0]} rows and {work.block_tables.shape[1] * block_size} tokens of block table")
    return block_size, kv_heads, head_dim, query.shape[1] // kv_heads


def _bind(fn: Any, argtypes: list[Any], restype: Any = None) -> Any:
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _require_contiguous_cpu(*tensors: tuple[str, torch.Tensor, torch.dtype]) -> None:
    for name, t, dtype in tensors:
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} "
                             f"(contiguous={t.is_contiguous()}, device={t.device})")


# GGUF's quantized block formats quantized_linear.c reads, by GGML type id: bytes per 32 weights.
QUANTIZED_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
QUANTIZED_BLOCK = 32


def _require_quantized(blocks: torch.Tensor, block_format: int, in_features: int) -> None:
    _require_contiguous_cpu(("blocks", blocks, torch.uint8))
    if block_format not in QUANTIZED_BLOCK_BYTES:
        raise ValueError(f"unsupported block format {block_format} (supported: {sorted(QUANTIZED_BLOCK_BYTES)})")
    if in_features <= 0 or in_features % QUANTIZED_BLOCK:
        raise ValueError(f"in_features must be a positive multiple of {QUANTIZED_BLOCK}, got {in_features}")
    row_bytes = in_features // QUANTIZED_BLOCK * QUANTIZED_BLOCK_BYTES[block_format]
    if blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(f"blocks must be [out, {row_bytes}] for {in_features} features, got {tuple(blocks.shape)}")


_loaded: dict[Path, CpuKernels] = {}


def load_cpu_kernels(cache_dir: Path) -> CpuKernels:
    """Build (once per machine and source) and load the CPU kernels; raises CpuKernelBuildError."""
    if cache_dir not in _loaded:
        _loaded[cache_dir] = CpuKernels(ctypes.CDLL(str(_build(cache_dir))))
    return _loaded[cache_dir]
