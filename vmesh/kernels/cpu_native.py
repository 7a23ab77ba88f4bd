"""CPU kernels in C (`vmesh/kernels/cpu/*.c`), compiled on first use with the machine's C compiler
and loaded with ctypes.

The shared object is cached under `<cache_dir>/kernels/`, keyed by a hash of the sources, the
compiler's version, the compile and link flags and the CPU's flags, and written to a temporary
name first, so processes starting at once never load a half-written file. Without a compiler
the callers keep their pure-torch path; `load_cpu_kernels` says why in its error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vmesh.kernels.cpu_checks import (
    KV_DTYPES,
    AttentionItems,
    PrefillChunks,
    attention_shape,
    cache_head_dim,
    int8_block_weight,
    reach,
    require_contiguous_cpu,
)

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "cpu"
SOURCES = sorted(KERNEL_DIR.glob("*.c"))
HEADERS = sorted(KERNEL_DIR.glob("*.h"))
# -march=native: the object is built on the machine that runs it, and cached per machine. An
# intrinsic whose header a CPU's flags left out must fail the build, not become an undefined
# symbol that fails every process loading the object.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=c11",
          "-Werror=implicit-function-declaration"]
LDFLAGS = ["-shared", "-fopenmp", "-lm"]  # after the objects (-lm must follow what needs it)


class QuantizedFormat(NamedTuple):
    name: str
    block_values: int  # weights per block: 32, or a K-quant's super-block of 256
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_values * self.block_bytes


# GGUF's quantized block formats that quantized_linear.c and integer_linear.c read, by GGML type id:
# the table of vmesh/kernels/cpu/gguf_blocks.h, for Python.
QUANTIZED_FORMATS = {2: QuantizedFormat("Q4_0", 32, 18), 3: QuantizedFormat("Q4_1", 32, 20),
                     6: QuantizedFormat("Q5_0", 32, 22), 8: QuantizedFormat("Q8_0", 32, 34),
                     12: QuantizedFormat("Q4_K", 256, 144), 14: QuantizedFormat("Q6_K", 256, 210)}


class CpuKernelBuildError(RuntimeError):
    pass


def _compiler() -> str:
    requested = os.environ.get("CC")
    compiler = shutil.which(requested) if requested else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise CpuKernelBuildError(f"C compiler {requested!r} (from CC) not found" if requested
                                  else "no C compiler found (install gcc, or set CC)")
    return compiler


def built_kernels_path(cache_dir: Path, compiler: str | None = None) -> Path:
    """Where this checkout's kernels, built by `compiler` for this CPU, lie in `cache_dir`."""
    compiler = compiler or _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    # -march=native differs by CPU; a cache dir shared between machines must not mix them.
    cpuinfo = Path("/proc/cpuinfo").read_bytes() if Path("/proc/cpuinfo").exists() else b""
    flags_line = next((line for line in cpuinfo.splitlines() if line.startswith(b"flags")), b"")
    sources = b"".join(path.name.encode() + path.read_bytes() for path in SOURCES + HEADERS)
    recipe = " ".join([*CFLAGS, "|", *LDFLAGS]).encode()
    key = hashlib.sha256(sources + version.encode() + recipe + flags_line).hexdigest()
    return cache_dir / "kernels" / f"vmesh-cpu-kernels-{key[:16]}.so"


def _build(cache_dir: Path) -> Path:
    compiler = _compiler()
    target = built_kernels_path(cache_dir, compiler)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        built = Path(staging) / target.name
        # A compiler per source, on the cores this process may use: in one compiler the build
        # is over a minute.
        objects = [Path(staging) / f"{source.stem}.o" for source in SOURCES]

        def compile_one(source: Path, obj: Path) -> str:
            done = subprocess.run([compiler, *CFLAGS, "-c", str(source), "-o", str(obj)], capture_output=True,
                                  text=True, check=False)
            return f"{source.name} (exit {done.returncode}): {done.stderr.strip()}" if done.returncode else ""

        with ThreadPoolExecutor(max_workers=min(len(SOURCES), len(os.sched_getaffinity(0)))) as pool:
            failed = [error for error in pool.map(compile_one, SOURCES, objects) if error]
        if not failed:
            linked = subprocess.run([compiler, *map(str, objects), "-o", str(built), *LDFLAGS],
                                    capture_output=True, text=True, check=False)
            failed = [f"linking (exit {linked.returncode}): {linked.stderr.strip()}"] if linked.returncode else []
        if failed:
            raise CpuKernelBuildError(f"{compiler} failed on vmesh/kernels/cpu:\n" + "\n".join(failed))
        os.replace(built, target)
    logger.info("built CPU kernels: %s", target)
    return target


# Each C kernel's arguments before its trailing `int num_threads`, and its result (an int status,
# 0 when done, or None): the signatures in vmesh/kernels/cpu/*.c, which ctypes cannot read. P: a pointer.
P, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ATTENTION = [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, F32, I64, P]
_PREFILL = [P, I64, P, P, P, I64, P, P, P, P, I64, I64, I64, I64, I64, F32, I64, P]
_NORM, _SILU, _ROTARY = [P, P, P, P, I64, I64, F32], [P, P, I64, I64], [P, I64, I64, I64, I64, I64, P, P, P, P, P]
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_attention_f32": (_ATTENTION, INT), "paged_attention_bf16": (_ATTENTION, INT),
    "prefill_attention_f32": (_PREFILL, INT), "prefill_attention_bf16": (_PREFILL, INT),
    "add_rms_norm_f32": (_NORM, None), "add_rms_norm_bf16": (_NORM, None),
    "silu_and_mul_f32": (_SILU, None), "silu_and_mul_bf16": (_SILU, None),
    "rotary_write_kv_f32": (_ROTARY, None), "rotary_write_kv_bf16": ([*_ROTARY, P], None),  # + float32 queries
    # The 8-bit KV cache's (vmesh/kernels/cpu/kv_int8.h): its writers per model dtype, its attention.
    "rotary_write_kv_f32_int8": (_ROTARY, None), "rotary_write_kv_bf16_int8": ([*_ROTARY, P], None),
    "paged_attention_int8": (_ATTENTION, INT), "prefill_attention_int8": (_PREFILL, INT),
    "small_batch_linear_f32": ([P, P, P, P, I64, I64, I64], None),
    "packed_small_batch_linear_f32": ([P, P, P, P, I64, I64, I64, I64], INT),
    # + whether x is bfloat16, and the layout's block width
    "packed_small_batch_linear_bf16": ([P, INT, P, P, P, I64, I64, I64, I64, I64], INT),
    # batch_linear_bf16.c: as above, over the 64-wide AVX-512 layout only
    "batch_linear_bf16": ([P, INT, P, P, P, I64, I64, I64, I64], INT),
    "quantized_linear_f32": ([P, P, INT, P, P, I64, I64, I64], INT),
    "quantized_linear_int8_f32": ([P, P, INT, P, P, I64, I64, I64], INT),  # x rounded to int8 per block
    "int8_linear_f32": ([P, P, P, P, P, P, I64, I64, I64], INT),
    # x, whether x is bfloat16, the packed weight, w_scale, bias, y, whether y is bfloat16, shape
    "int8_block_linear": ([P, INT, P, P, P, P, INT, I64, I64, I64], INT),
    "quantized_rows_f32": ([P, INT, P, I64, I64, I64, P], INT),
    # fused_linear.c: the norm's (x, residual, weight, eps), or gate_up, then quantized_linear's
    # arguments after x, then whether the product is the integer one.
    "rms_norm_quantized_linear_f32": ([P, P, P, F32, P, INT, P, P, I64, I64, I64, INT], INT),
    "silu_quantized_linear_f32": ([P, P, INT, P, P, I64, I64, I64, INT], INT),
    "apply_token_bitmask_f32": ([P, I64, P, I64, P, I64, I64], None),
    # decoder_stack.c: (hidden, residual, tokens, layers, num_layers, shape, attention work, cos, sin,
    # slot_mapping, then the scratch: qkv, attention, attention_out, gate_up); services/worker/decoder_stack.py.
    "decoder_stack_f32": ([P, P, I64, P, I64, P, P, P, P, P, P, P, P, P], INT),
    # The same in `--weights int8 --dtype bfloat16`; its scratch: normed, qkv, query, attention,
    # attention_out, gate_up, activated.
    "decoder_stack_int8_bf16": ([P, P, I64, P, I64, P, P, P, P, P, P, P, P, P, P, P, P], INT),
}
# The C kernels' name suffix per model dtype. bfloat16 is the mixed model's: bfloat16 activations,
# weights and KV cache around a float32 residual stream; attention's softmax and sums in float32.
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# The attention kernels' suffix per KV cache dtype.
_CACHE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "int8"}


class CpuKernels:
    def __init__(self, library: ctypes.CDLL):
        self._functions = {name: _bind(getattr(library, name), [*argtypes, INT], restype)
                           for name, (argtypes, restype) in _SIGNATURES.items()}
        limits = [ctypes.c_int64() for _ in range(4)]
        _bind(library.vmesh_kernel_limits, [ctypes.POINTER(ctypes.c_int64)] * 4)(*map(ctypes.byref, limits))
        # vmesh/kernels/cpu/kernel_limits.h: beyond these the attention kernels refuse a shape; up to
        # stream_rows rows the linear kernels make one streaming pass over a weight.
        self.max_heads, self.max_head_dim, self.prefill_head_dim_multiple, self.stream_rows = (
            limit.value for limit in limits)
        # Whether vmesh/kernels/cpu/integer_linear.c was built with AVX-512 VNNI (-march=native: this CPU has it).
        self.integer_dot = bool(_bind(library.vmesh_integer_dot_available, [], INT)())
        # Whether the kernels were built with AVX-512 BF16 (the same way): batch_linear_bf16.c's products,
        # and the attention kernels' pair dots over a bfloat16 cache (queries and softmax weights rounded
        # to bfloat16: prefill_attention.c, paged_attention_pairs.h for head_dim 64 or 128).
        self.bf16_dot = bool(_bind(library.vmesh_batch_linear_bf16_available, [], INT)())
        # Whether decode attention over an 8-bit KV cache multiplies on 16-bit integer pair dots (AVX-512
        # VNNI; vmesh/kernels/cpu/paged_attention_words.h, head_dim 64 or 128), else in float32.
        self.int8_words = bool(_bind(library.vmesh_int8_words_available, [], INT)())
        # int8_linear.c's batch path: inputs per activation scale (the packed layout's widths divide by it).
        self.int8_block_inputs = int(_bind(library.vmesh_int8_block_inputs, [], INT)())

    def _kernel(self, op: str, dtype: torch.dtype) -> Any:
        """The C function of `op` for a model of `dtype` (float32, or the mixed bfloat16)."""
        if dtype not in _SUFFIXES:
            raise ValueError(f"{op} has no {dtype} kernel (float32 or bfloat16)")
        return self._functions[f"{op}_{_SUFFIXES[dtype]}"]

    def _cache_kernel(self, op: str, cache_dtype: torch.dtype) -> Any:
        """The C function of attention `op` over a KV cache of `cache_dtype`."""
        if cache_dtype not in _CACHE_SUFFIXES:
            raise ValueError(f"{op} has no kernel for a {cache_dtype} KV cache (float32, bfloat16 or int8)")
        return self._functions[f"{op}_{_CACHE_SUFFIXES[cache_dtype]}"]

    # The elementwise ops below run 3-4 times per layer: they check only dtype and layout,
    # which is what a wrong pointer would corrupt memory through. `dtype` is the model's.

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     *, dtype: torch.dtype = torch.float32) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """vmesh.kernels.reference.rms_norm_ref's contract for 2-D x, except that `residual`
        is updated in place to x + residual (and returned) rather than copied. The residual stream
        and the weight are float32, the output `dtype`. Without `residual`, x is that float32
        stream (left as it is); with it, x is a `dtype` output added to `residual` in place."""
        if x.dim() != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"x must be [rows, dim] with a weight of [dim], got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
        kernel = self._kernel("add_rms_norm", dtype)
        if residual is None:
            require_contiguous_cpu(("x", x, torch.float32), ("weight", weight, torch.float32))
            out = torch.empty(x.shape, dtype=dtype)
            kernel(0, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                   torch.get_num_threads())
            return out
        require_contiguous_cpu(("x", x, dtype), ("residual", residual, torch.float32),
                               ("weight", weight, torch.float32))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        out = torch.empty(x.shape, dtype=dtype)
        kernel(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
               torch.get_num_threads())
        return out, residual

    def silu_and_mul(self, gate_up: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, 2 * inter] (gate, up) -> silu(gate) * up, as vmesh.kernels.reference.silu_and_mul_ref,
        in and out in `dtype` (computed in float32 and rounded once)."""
        require_contiguous_cpu(("gate_up", gate_up, dtype))
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [rows, 2 * inter], got {tuple(gate_up.shape)}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=dtype)
        self._kernel("silu_and_mul", dtype)(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rotary_write_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) * head_dim], rows contiguous, and the caches in `dtype`:
        rotates queries and keys (RotaryEmbedding.apply), writes keys and values to the caches at
        slot_mapping (-1: skipped) and returns the float32 queries [tokens, heads, head_dim].
        cos, sin: float32 [tokens, head_dim] (or [tokens, 1, head_dim]) rows for the tokens' positions.
        float32 rotates qkv in place and returns a view of it; bfloat16 leaves qkv as it is, returns
        a new float32 tensor of the rotated queries rounded to bfloat16 (prefill attention multiplies
        them in bfloat16 pairs; the sums stay float32) and rounds the rotated keys into the cache.
        An int8 cache (either model dtype; vmesh/kernels/cpu/kv_int8.h) takes each rotated key and
        each value as its codes and scale."""
        head_dim = cache_head_dim(key_cache)
        kernel = self._kernel("rotary_write_kv", dtype)
        cache_dtype = dtype
        if key_cache.dtype == torch.int8:
            if dtype == torch.bfloat16 and head_dim > self.max_head_dim:  # it rotates a key in a buffer of that size
                raise ValueError(f"an 8-bit KV cache takes heads of up to {self.max_head_dim}, not {head_dim}")
            kernel, cache_dtype = self._functions[f"rotary_write_kv_{_SUFFIXES[dtype]}_int8"], torch.int8
        if qkv.dtype != dtype or qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"qkv must be {str(dtype).removeprefix('torch.')} "
                             f"[tokens, {(heads + 2 * kv_heads) * head_dim}] with contiguous rows")
        if key_cache.shape[2] != kv_heads or value_cache.shape != key_cache.shape or head_dim % 2:
            raise ValueError(f"caches of shape {tuple(key_cache.shape)} do not fit {kv_heads} KV heads")
        require_contiguous_cpu(("cos", cos, torch.float32), ("sin", sin, torch.float32),
                               ("key_cache", key_cache, cache_dtype), ("value_cache", value_cache, cache_dtype),
                               ("slot_mapping", slot_mapping, torch.int64))
        tokens = qkv.shape[0]
        if cos.numel() != tokens * head_dim or sin.numel() != tokens * head_dim or slot_mapping.numel() != tokens:
            raise ValueError("cos, sin and slot_mapping need one row per token")
        query_out: tuple[int, ...] = ()  # float32: the queries are rotated in place
        if dtype == torch.float32:
            query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        else:
            query = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
            query_out = (query.data_ptr(),)
        kernel(qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
               slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), *query_out,
               torch.get_num_threads())
        return query

    def small_batch_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ weight.T + bias for a few rows (memory bound: one pass over weight).
        Every tensor must be contiguous float32 on the CPU; the caller (Linear) guarantees it."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._functions["small_batch_linear_f32"](x.data_ptr(), weight.data_ptr(),
                                                  0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                                  weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out

    def packed_small_batch_linear(self, x: torch.Tensor, packed_weight_address: int, out_features: int,
                                  padded_in_features: int, bias: torch.Tensor | None, *,
                                  dtype: torch.dtype = torch.float32, out_block: int = 64) -> torch.Tensor:
        """small_batch_linear over oneDNN's packed copy of a `dtype` weight, at its raw address, in
        the layout that services/worker/linear.py checked at load (see small_batch_linear.c):
        OI16i64o for float32, AB16b64a2b or AB16b32a2b (out_block 32) for bfloat16. x: contiguous
        [1 to stream_rows rows, in], float32 (or bfloat16 for a bfloat16 weight); the caller (Linear)
        guarantees it. bias: `dtype`, as the result is."""
        kernel, name = self._kernel("packed_small_batch_linear", dtype), f"packed_small_batch_linear_{_SUFFIXES[dtype]}"
        _require_packed_bias(name, bias, dtype, out_features)
        # The bfloat16 kernel widens either input, and is told which it has.
        source = (x.data_ptr(),) if dtype == torch.float32 else (x.data_ptr(), int(x.dtype == torch.bfloat16))
        layout = (padded_in_features,) if dtype == torch.float32 else (padded_in_features, out_block)
        out = torch.empty(x.shape[0], out_features, dtype=dtype)
        status = kernel(*source, packed_weight_address, 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                        x.shape[0], out_features, x.shape[1], *layout, torch.get_num_threads())
        _check_packed_status(status, name, x, padded_in_features)
        return out

    def packed_batch_linear_bf16(self, x: torch.Tensor, packed_weight_address: int, out_features: int,
                                 padded_in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias over oneDNN's packed copy of a bfloat16 weight in its 64-wide AVX-512 layout
        (AB16b64a2b, checked at load by services/worker/linear.py), on AVX-512 BF16 dot products
        (vmesh/kernels/cpu/batch_linear_bf16.c; needs `bf16_dot`), for any number of rows. x:
        contiguous [rows, in], bfloat16 or float32 (rounded to bfloat16 first); bias bfloat16 [out]."""
        name = "batch_linear_bf16"
        _require_packed_bias(name, bias, torch.bfloat16, out_features)
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: x must be 2-D bfloat16 or float32, got {x.dtype} {tuple(x.shape)}")
        require_contiguous_cpu(("x", x, x.dtype))
        out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
        status = self._functions[name](x.data_ptr(), int(x.dtype == torch.bfloat16), packed_weight_address,
                                       0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                       out_features, x.shape[1], padded_in_features, torch.get_num_threads())
        _check_packed_status(status, name, x, padded_in_features)
        return out

    def quantized_linear(self, x: torch.Tensor, blocks: torch.Tensor, block_format: int, in_features: int,
                         bias: torch.Tensor | None, *, integer: bool = False) -> torch.Tensor:
        """x [rows, in] @ W.T + bias with W [out, in] held as GGUF blocks: `blocks` is uint8
        [out, in / block values * block bytes] in `block_format` (a GGML type id of QUANTIZED_FORMATS;
        see vmesh/kernels/cpu/gguf_blocks.h). `integer`: x rounded to int8 per block of 32 and multiplied
        on integer dot products (vmesh/kernels/cpu/integer_linear.c; needs `integer_dot`). Checked here:
        the call reads raw pointers."""
        return self.quantized_product(blocks, block_format, in_features, bias, integer=integer)(x)

    def quantized_product(self, blocks: torch.Tensor, block_format: int, in_features: int, bias: torch.Tensor | None,
                          *, integer: bool = False) -> QuantizedProduct:
        """quantized_linear with the weight and bias checked once, here: the QuantizedProduct returned
        takes x and checks only x (a layer calls it once per step; the weight's checks cost more than
        the product of a single row's small layer)."""
        _require_quantized(blocks, block_format, in_features)
        out_features = blocks.shape[0]
        if bias is not None:
            require_contiguous_cpu(("bias", bias, torch.float32))
            if bias.shape != (out_features,):
                raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        return QuantizedProduct(self._functions, blocks, block_format, in_features, bias, integer)

    def int8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] rounded to 16 bits per row, @ (weight * scale[:, None]).T + bias, in C
        (vmesh/kernels/cpu/int8_linear.c).
        weight int8 [out, in], scale float32 [out], row_sums int32 [out] (weight.sum(1)), bias float32
        [out]: contiguous, as services/worker/int8_linear.py builds them at load; x is checked here."""
        require_contiguous_cpu(("x", x, torch.float32))
        if x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"x must be [rows, {weight.shape[1]}], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        status = self._functions["int8_linear_f32"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                                                    row_sums.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                                    out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                                                    torch.get_num_threads())
        if status:
            raise (MemoryError if status == 2 else RuntimeError)(f"int8_linear_f32 failed with status {status}")
        return out

    def int8_block_linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x [rows, in] rounded to 8 bits per block of `int8_block_inputs`, @ W.T + bias, in C
        (int8_block_linear in vmesh/kernels/cpu/int8_linear.c): x float32 or bfloat16, the result in
        out_dtype (either). packed uint8 [ceil(out / 16), in / 4, 16, 4] (int8_linear.py's
        pack_for_blocks), scale and bias float32 [out]; every shape the C reads by is checked here."""
        if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x and the result are float32 or bfloat16, got {x.dtype} and {out_dtype}")
        require_contiguous_cpu(("x", x, x.dtype))
        out_features, in_features = int8_block_weight(packed, scale, bias, self.int8_block_inputs)
        if x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
        status = self._functions["int8_block_linear"](
            x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(), scale.data_ptr(),
            0 if bias is None else bias.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16), x.shape[0],
            out_features, in_features, torch.get_num_threads())
        if status:
            raise (MemoryError if status == 2 else RuntimeError)(f"int8_block_linear failed with status {status}")
        return out

    def quantized_rows(self, blocks: torch.Tensor, block_format: int, in_features: int,
                       ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` (1-D int64) of a weight held as GGUF blocks (see quantized_linear)."""
        _require_quantized(blocks, block_format, in_features)
        require_contiguous_cpu(("ids", ids, torch.int64))
        out = torch.empty(ids.numel(), in_features, dtype=torch.float32)
        if self._functions["quantized_rows_f32"](blocks.data_ptr(), block_format, ids.data_ptr(), ids.numel(),
                                                 blocks.shape[0], in_features, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"ids must lie in [0, {blocks.shape[0]})")
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
        """Set logits[r, t] to -inf wherever bit t of bitmask[r] is clear, for each r in `rows`
        (None: every logits row): vmesh/kernels/cpu/token_bitmask.c. logits: float32 [B, vocab] with
        contiguous rows; bitmask: int32 [>= B, ceil(vocab / 32)] with contiguous rows, both on
        the CPU. Checked here: the call writes through raw pointers."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("logits must be a CPU float32 [rows, vocab] tensor with contiguous rows")
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or bitmask.stride(1) != 1:
            raise ValueError("the bitmask must be a CPU int32 [rows, words] tensor with contiguous rows")
        vocab = logits.shape[1]
        if bitmask.shape[1] * 32 < vocab:
            raise ValueError(f"a bitmask of {bitmask.shape[1]} words per row does not cover {vocab} logits")
        limit = min(logits.shape[0], bitmask.shape[0])
        if rows is None and bitmask.shape[0] < logits.shape[0]:
            raise ValueError(f"a bitmask of {bitmask.shape[0]} rows does not cover {logits.shape[0]} logits rows")
        if rows and (min(rows) < 0 or max(rows) >= limit):
            raise ValueError(f"rows must lie in [0, {limit})")
        indices = None if rows is None else torch.tensor(rows, dtype=torch.int64)
        num_rows = logits.shape[0] if indices is None else indices.numel()
        self._functions["apply_token_bitmask_f32"](logits.data_ptr(), logits.stride(0), bitmask.data_ptr(),
                                                   bitmask.stride(0), 0 if indices is None else indices.data_ptr(),
                                                   num_rows, vocab, torch.get_num_threads())

    def supports(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """float32 queries over a float32, bfloat16 or int8 cache, in the kernels' size limits."""
        return (query.is_cpu and query.dtype == torch.float32 and key_cache.dtype in KV_DTYPES
                and query.shape[1] <= self.max_heads and cache_head_dim(key_cache) <= self.max_head_dim)

    def supports_prefill(self, key_cache: torch.Tensor) -> bool:
        """Whether prefill_attention takes this cache's head size (the per-token kernel takes any)."""
        return cache_head_dim(key_cache) % self.prefill_head_dim_multiple == 0

    @staticmethod
    def attention_items(block_tables: torch.Tensor, request_rows: torch.Tensor, token_rows: torch.Tensor,
                        context_lens: torch.Tensor) -> AttentionItems:
        """Checked once per step; every layer's call reuses it."""
        require_contiguous_cpu(("block_tables", block_tables, torch.int32),
                               ("request_rows", request_rows, torch.int64), ("token_rows", token_rows, torch.int64),
                               ("context_lens", context_lens, torch.int32))
        if not request_rows.numel() == token_rows.numel() == context_lens.numel():
            raise ValueError("request_rows, token_rows and context_lens need one entry per query token")
        return AttentionItems(block_tables, request_rows, token_rows, context_lens,
                              *reach(block_tables, request_rows, token_rows + 1, context_lens))

    @staticmethod
    def prefill_chunks(block_tables: torch.Tensor, requests: torch.Tensor, starts: torch.Tensor,
                       lengths: torch.Tensor, seq_lens: torch.Tensor) -> PrefillChunks:
        """Checked once per step; every layer's call reuses it."""
        require_contiguous_cpu(("block_tables", block_tables, torch.int32), ("requests", requests, torch.int64),
                               ("starts", starts, torch.int64), ("lengths", lengths, torch.int32),
                               ("seq_lens", seq_lens, torch.int32))
        if not requests.numel() == starts.numel() == lengths.numel() == seq_lens.numel():
            raise ValueError("requests, starts, lengths and seq_lens need one entry per chunk")
        if bool((lengths < 1).any()) or bool((seq_lens < lengths).any()):
            raise ValueError("every chunk needs 1 <= length <= seq_len")
        return PrefillChunks(block_tables, requests, starts, lengths, seq_lens,
                             *reach(block_tables, requests, starts + lengths, seq_lens))

    def prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          chunks: PrefillChunks, scale: float, out: torch.Tensor, window: int | None = None) -> None:
        """For each chunk, causal attention of its query rows over its request's cached context
        (the chunk's own keys included; with `window`, only the last `window` positions up to each
        token's own), written to the same rows of out. Shapes and layouts:
        see vmesh/kernels/cpu/prefill_attention.c; head_dim must be a multiple of prefill_head_dim_multiple.
        The caches may be bfloat16 or int8 (the query and out stay float32); where `bf16_dot`, the scores
        over either then take the query rounded to bfloat16 (the bfloat16 mode's queries are) and the
        value sums the softmax weights rounded to bfloat16 (tests/support/paged.py bounds the error), an
        8-bit cache's rows rounded to bfloat16 first."""
        block_size, kv_heads, head_dim, group = attention_shape(query, key_cache, value_cache, out, chunks)
        kernel = self._cache_kernel("prefill_attention", key_cache.dtype)
        status = kernel(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                        chunks.block_tables.data_ptr(), chunks.block_tables.shape[1], chunks.requests.data_ptr(),
                        chunks.starts.data_ptr(), chunks.lengths.data_ptr(), chunks.seq_lens.data_ptr(),
                        chunks.requests.numel(), kv_heads, group, head_dim, block_size, scale, _window(window),
                        out.data_ptr(), torch.get_num_threads())
        if status == 1:
            raise ValueError(f"unsupported prefill attention shape: group {group}, head_dim {head_dim}")
        if status == 2:
            raise MemoryError("prefill_attention: out of memory for its tiles")

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        items: AttentionItems, scale: float, out: torch.Tensor, window: int | None = None) -> None:
        """For each item i, writes out[token_rows[i]] = attention of query[token_rows[i]] over the
        first context_lens[i] cached tokens of block_tables[request_rows[i]] (with `window`, the
        last `window` of them). Shapes and
        layouts: see vmesh/kernels/cpu/paged_attention.h. The caches may be bfloat16 or int8 (the query
        and out stay float32; over an 8-bit cache, where `int8_words`, the query and the softmax
        weights are rounded to 16 bits: vmesh/kernels/cpu/paged_attention_words.h)."""
        block_size, kv_heads, head_dim, group = attention_shape(query, key_cache, value_cache, out, items)
        kernel = self._cache_kernel("paged_attention", key_cache.dtype)
        status = kernel(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                        items.block_tables.data_ptr(), items.block_tables.shape[1], items.request_rows.data_ptr(),
                        items.token_rows.data_ptr(), items.context_lens.data_ptr(), items.token_rows.numel(),
                        kv_heads, group, head_dim, block_size, scale, _window(window), out.data_ptr(),
                        torch.get_num_threads())
        if status == 1:
            raise ValueError(f"unsupported attention shape: group {group}, head_dim {head_dim}")
        if status == 2:
            raise MemoryError("paged_attention: out of memory for the score buffer")


class QuantizedProduct:
    """CpuKernels.quantized_linear over one checked weight (CpuKernels.quantized_product), alone or
    with the elementwise op that feeds it in the same C call (vmesh/kernels/cpu/fused_linear.c): RMSNorm
    with the residual add, or SiLU-and-multiply. Each call checks its own tensors only. Holds
    `blocks` and `bias`, whose addresses it reads."""

    def __init__(self, functions: dict[str, Any], blocks: torch.Tensor, block_format: int, in_features: int,
                 bias: torch.Tensor | None, integer: bool):
        self._functions = functions  # looked up per call, as every kernel is (benchmarks/step_breakdown.py times them)
        self._held = (blocks, bias)
        self.name = "quantized_linear_int8_f32" if integer else "quantized_linear_f32"
        self.integer = int(integer)
        self.out_features, self.in_features, self.block_format = blocks.shape[0], in_features, block_format
        self._weight = (blocks.data_ptr(), block_format, 0 if bias is None else bias.data_ptr())

    @property
    def pointers(self) -> tuple[int, int, int]:
        """(the blocks' address, the block format, the bias's address or 0): what a C caller passes
        for this weight (services/worker/decoder_stack.py); valid while this product lives."""
        return self._weight

    def _rows(self, x: torch.Tensor, name: str, width: int) -> int:
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{name} must be a contiguous CPU float32 [rows, {width}] tensor, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        return x.shape[0]

    def _checked(self, status: int, name: str, rows: int) -> None:
        if status:
            raise kernel_status_error(status, name, f"{rows} rows of {self.in_features} features")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T + bias."""
        rows = self._rows(x, "x", self.in_features)
        out = torch.empty(rows, self.out_features)
        blocks, block_format, bias = self._weight
        self._checked(self._functions[self.name](x.data_ptr(), blocks, block_format, bias, out.data_ptr(), rows,
                                                 self.out_features, self.in_features, torch.get_num_threads()),
                      self.name, rows)
        return out

    def after_rms_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this product over CpuKernels.add_rms_norm(x, norm_weight, eps, residual), the residual
        stream): with `residual`, x is added to it in place and it is returned; without, x is the
        stream (left as it is, and returned)."""
        rows = self._rows(x, "x", self.in_features)
        require_contiguous_cpu(("norm_weight", norm_weight, torch.float32))
        if norm_weight.shape != (self.in_features,):
            raise ValueError(f"norm_weight must be [{self.in_features}], got {tuple(norm_weight.shape)}")
        if residual is not None:
            self._rows(residual, "residual", self.in_features)
            if residual.shape[0] != rows:
                raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        stream = x if residual is None else residual
        out = torch.empty(rows, self.out_features)
        blocks, block_format, bias = self._weight
        self._checked(self._functions["rms_norm_quantized_linear_f32"](
            0 if residual is None else x.data_ptr(), stream.data_ptr(), norm_weight.data_ptr(), eps, blocks,
            block_format, bias, out.data_ptr(), rows, self.out_features, self.in_features, self.integer,
            torch.get_num_threads()), "rms_norm_quantized_linear_f32", rows)
        return out, stream

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) @ W.T + bias for gate_up [rows, 2 * in] (CpuKernels.silu_and_mul's input)."""
        rows = self._rows(gate_up, "gate_up", 2 * self.in_features)
        out = torch.empty(rows, self.out_features)
        blocks, block_format, bias = self._weight
        self._checked(self._functions["silu_quantized_linear_f32"](
            gate_up.data_ptr(), blocks, block_format, bias, out.data_ptr(), rows, self.out_features, self.in_features,
            self.integer, torch.get_num_threads()), "silu_quantized_linear_f32", rows)
        return out


def _require_packed_bias(name: str, bias: torch.Tensor | None, dtype: torch.dtype, out_features: int) -> None:
    """A packed product's bias, read through a raw pointer: None, or contiguous `dtype` [out_features]."""
    if bias is not None and (bias.dtype != dtype or bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be contiguous {str(dtype).removeprefix('torch.')} "
                         f"[{out_features}], got {bias.dtype} {tuple(bias.shape)}")


def _check_packed_status(status: int, name: str, x: torch.Tensor, padded_in_features: int) -> None:
    """A packed product's nonzero status as its error (small_batch_linear.c's and batch_linear_bf16.c's): 2 out
    of memory, 3 built without AVX-512 BF16, else a shape the weight does not take."""
    if status == 2:
        raise MemoryError(f"{name}: out of memory")
    if status == 3:
        raise RuntimeError(f"{name}: built without AVX-512 BF16 (see CpuKernels.bf16_dot)")
    if status:
        raise ValueError(f"{name}: {x.shape[0]} rows of {x.shape[1]} features do not fit a packed weight of "
                         f"{padded_in_features} input features")


def kernel_status_error(status: int, name: str, refused: str) -> Exception:
    """The error for a quantized product's nonzero status (vmesh/kernels/cpu/quantized_linear.c's, integer_linear.c's
    and those of the calls built on them): 1 refused `refused`, 2 out of memory, 3 built without VNNI."""
    if status == 2:
        return MemoryError(f"{name}: out of memory for its scratch")
    if status == 3:
        return RuntimeError(f"{name}: built without AVX-512 VNNI (see CpuKernels.integer_dot)")
    return ValueError(f"{name} refused {refused}")


def _window(window: int | None) -> int:
    """A sliding window as the attention kernels take it: 0 for none."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}")
    return window or 0


def _bind(fn: Any, argtypes: list[Any], restype: Any = None) -> Any:
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _require_quantized(blocks: torch.Tensor, block_format: int, in_features: int) -> None:
    require_contiguous_cpu(("blocks", blocks, torch.uint8))
    if block_format not in QUANTIZED_FORMATS:
        raise ValueError(f"unsupported block format {block_format} (supported: {sorted(QUANTIZED_FORMATS)})")
    block = QUANTIZED_FORMATS[block_format]
    if in_features <= 0 or in_features % block.block_values:
        raise ValueError(f"in_features must be a positive multiple of {block.block_values} for {block.name}, "
                         f"got {in_features}")
    row_bytes = block.row_bytes(in_features)
    if blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(f"blocks must be [out, {row_bytes}] for {in_features} features, got {tuple(blocks.shape)}")


_loaded: dict[Path, CpuKernels] = {}


def load_cpu_kernels(cache_dir: Path) -> CpuKernels:
    """Build (once per machine and source) and load the CPU kernels; raises CpuKernelBuildError."""
    if cache_dir not in _loaded:
        _loaded[cache_dir] = CpuKernels(ctypes.CDLL(str(_build(cache_dir))))
    return _loaded[cache_dir]
