"""tools/gpu_check.py's kernel section: every Triton kernel of vmesh/kernels/ against its torch reference
(vmesh/kernels/reference.py) on one device, in float32 and bfloat16, on the CPU tests' shapes and on large
ones. On a CPU (the dry run) the kernels run through the Triton interpreter, small shapes only."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.paged import ragged_batch
from tests.unit.test_kernels import CASES as ATTENTION_CASES
from tests.unit.test_sliding_window_kernels import CONTEXT_LENS as WINDOW_CONTEXT_LENS
from tests.unit.test_sliding_window_kernels import QUERY_LENS as WINDOW_QUERY_LENS
from tests.unit.test_sliding_window_kernels import SHAPES as WINDOW_SHAPES
from vmesh.kernels import reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# float32: the CPU tests' tolerance, looser on long contexts (sums of thousands of terms); bfloat16:
# one rounding of the output (torch.testing's own bfloat16 tolerance), twice that for elementwise ops
# whose reference rounds twice.
TOL = {("float32", False): 2e-5, ("float32", True): 1e-4, ("bfloat16", False): 1.6e-2, ("bfloat16", True): 1.6e-2}
# Large shapes: a Llama-3-8B-like attention (32 query heads over 8 KV heads of 128) and the
# embedded model's (9 over 3 of 64), over a batch of decodes and long prefill chunks.
LARGE_ATTENTION = [(128, 32, 8, 16), (64, 9, 3, 16)]


@functools.lru_cache(maxsize=16)
def _float32_batch(query_lens: tuple[int, ...], context_lens: tuple[int, ...], heads: int, kv_heads: int,
                   head_dim: int, block_size: int, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    # Once per shape: the large ones take seconds of CPU to draw, and each serves both dtypes and windows.
    return ragged_batch(list(query_lens), list(context_lens), heads, kv_heads, head_dim, block_size, torch.float32,
                        seed=seed, device=device)


def _batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
           dtype: str, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """tests/support/paged.py's ragged batch (whose values are drawn in float32, then cast)."""
    q, kc, vc, starts, seq_lens, tables = _float32_batch(tuple(query_lens), tuple(context_lens), heads, kv_heads,
                                                         head_dim, block_size, seed, device)
    return q.to(DTYPES[dtype]), kc.to(DTYPES[dtype]), vc.to(DTYPES[dtype]), starts, seq_lens, tables


@dataclass
class Case:
    kernel: str
    label: str
    dtype: str
    large: bool
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # (kernel's output, reference's)
    elementwise: bool = False


def _attention(label: str, dtype: str, large: bool, device: str, query_lens: list[int], context_lens: list[int],
               geometry: tuple[int, int, int, int], window: int | None = None, block_m: int = 16) -> Case:
    from vmesh.kernels.paged_attention import unified_attention

    head_dim, heads, kv_heads, block_size = geometry

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q, kc, vc, starts, seq_lens, tables = _batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size,
                                                     dtype, device)
        scale = head_dim ** -0.5
        got = unified_attention(q, kc, vc, starts, seq_lens, tables, scale, max_query_len=max(query_lens),
                                block_m=block_m, window=window)
        return got, reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, scale, window=window)

    return Case("unified_attention", label, dtype, large, run)


def _split_kv(label: str, dtype: str, large: bool, device: str, context_lens: list[int],
              geometry: tuple[int, int, int, int], num_splits: int) -> Case:
    from vmesh.kernels.paged_attention import split_kv_decode_attention

    head_dim, heads, kv_heads, block_size = geometry

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q, kc, vc, starts, seq_lens, tables = _batch([1] * len(context_lens), context_lens, heads, kv_heads, head_dim,
                                                     block_size, dtype, device, seed=1)
        scale = head_dim ** -0.5
        got = split_kv_decode_attention(q, kc, vc, seq_lens, tables, scale, num_splits=num_splits)
        return got, reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, scale)

    return Case("split_kv_decode_attention", label, dtype, large, run)


def _write_kv(dtype: str, large: bool, device: str) -> Case:
    from vmesh.kernels.kv_cache_write import write_kv

    tokens, kv_heads, head_dim, blocks = (8192, 8, 128, 600) if large else (6, 3, 64, 2)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(2)
        key = torch.randn((tokens, kv_heads, head_dim), generator=g, device=device).to(DTYPES[dtype])
        value = torch.randn((tokens, kv_heads, head_dim), generator=g, device=device).to(DTYPES[dtype])
        slots = torch.randperm(blocks * 16, generator=g, device=device)[:tokens]
        slots[::5] = -1  # padding tokens write nothing
        caches = [torch.zeros((blocks, 16, kv_heads, head_dim), dtype=DTYPES[dtype], device=device) for _ in range(4)]
        write_kv(key, value, caches[0], caches[1], slots)
        reference.write_kv_ref(key, value, caches[2], caches[3], slots)
        return torch.stack(caches[:2]), torch.stack(caches[2:])

    return Case("write_kv", f"{tokens} tokens x {kv_heads} x {head_dim}", dtype, large, run)


def _rms_norm(dtype: str, large: bool, device: str, with_residual: bool) -> Case:
    from vmesh.kernels.fused_ops import rms_norm

    rows, width = (8192, 4096) if large else (5, 96)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(3)
        x = torch.randn((rows, width), generator=g, device=device).to(DTYPES[dtype])
        residual = torch.randn((rows, width), generator=g, device=device).to(DTYPES[dtype]) if with_residual else None
        weight = torch.randn(width, generator=g, device=device).to(DTYPES[dtype])
        got, want = rms_norm(x, weight, 1e-5, residual), reference.rms_norm_ref(x, weight, 1e-5, residual)
        if isinstance(got, tuple) and isinstance(want, tuple):
            return torch.cat(got), torch.cat(want)
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        return got, want

    label = f"{rows}x{width}" + (" + residual" if with_residual else "")
    return Case("rms_norm", label, dtype, large, run, elementwise=True)


def _silu_and_mul(dtype: str, large: bool, device: str) -> Case:
    from vmesh.kernels.fused_ops import silu_and_mul

    rows, inter, block = (4096, 14336, 1024) if large else (4, 80, 32)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(4)
        x = torch.randn((rows, 2 * inter), generator=g, device=device).to(DTYPES[dtype])
        return silu_and_mul(x, block=block), reference.silu_and_mul_ref(x)

    return Case("silu_and_mul", f"{rows}x{2 * inter}", dtype, large, run, elementwise=True)


def cases(device: str, dry_run: bool) -> Iterator[Case]:
    """On a GPU: every shape of the CPU tests, then the large ones. The dry run (the interpreter, on
    a CPU): the first of each kind, with attention in float32 only (the interpreter takes seconds
    per attention case) and rms_norm too (its bfloat16 arithmetic is the interpreter's, which numpy
    cannot do: NaN)."""
    for dtype in DTYPES:
        attention = not dry_run or dtype == "float32"
        for head_dim, heads, kv_heads, block_size, _test_dtype in ATTENTION_CASES[:1] if dry_run else ATTENTION_CASES:
            geometry = (head_dim, heads, kv_heads, block_size)
            for window in (None, 7) if not dry_run else (7,) if attention else ():
                yield _attention(f"{geometry} mixed batch" + (f" window={window}" if window else ""), dtype, False,
                                 device, [7, 5, 1, 1], [0, 19, 33, 4], geometry, window, block_m=4)
            for splits in (1, 3) if not dry_run else (3,) if attention else ():
                yield _split_kv(f"{geometry} splits={splits}", dtype, False, device, [37, 5, 70], geometry, splits)
        for head_dim, heads, kv_heads in () if dry_run else WINDOW_SHAPES:
            for window in (1, 7, 40):
                yield _attention(f"{(head_dim, heads, kv_heads, 16)} window={window}", dtype, False, device,
                                 WINDOW_QUERY_LENS, WINDOW_CONTEXT_LENS, (head_dim, heads, kv_heads, 16), window)
        yield _write_kv(dtype, False, device)
        for with_residual in (False, True) if not dry_run or dtype == "float32" else ():
            yield _rms_norm(dtype, False, device, with_residual)
        yield _silu_and_mul(dtype, False, device)
        if dry_run:
            continue
        g = torch.Generator().manual_seed(5)
        contexts = torch.randint(1, 4000, (48,), generator=g).tolist()
        for geometry in LARGE_ATTENTION:
            query_lens, context_lens = [1] * 48 + [384, 96], [*contexts, 0, 1500]
            yield _attention(f"{geometry} 48 decodes + 2 prefill chunks", dtype, True, device, query_lens,
                             context_lens, geometry)
            yield _attention(f"{geometry} window=512", dtype, True, device, query_lens, context_lens, geometry,
                             window=512)
            yield _split_kv(f"{geometry} 16 decodes to 8192, splits=8", dtype, True, device,
                            [8192, 300, *contexts[:14]], geometry, 8)
        yield _write_kv(dtype, True, device)
        yield _rms_norm(dtype, True, device, with_residual=True)
        yield _silu_and_mul(dtype, True, device)


def check_kernels(device: str, dry_run: bool) -> dict[str, Any]:
    """Each case's largest error and whether it is within its tolerance; passed when all are."""
    rows: list[dict[str, Any]] = []
    for case in cases(device, dry_run):
        got, want = case.run()
        error = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        tol = TOL[(case.dtype, case.large)] * (2 if case.elementwise and case.dtype == "bfloat16" else 1)
        try:
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            ok, note = True, ""
        except AssertionError as exc:
            ok, note = False, str(exc).strip().splitlines()[0]
        rows.append({"kernel": case.kernel, "case": case.label, "dtype": case.dtype, "large": case.large,
                     "max_abs_error": error, "tolerance": tol, "ok": ok, **({"note": note} if note else {})})
        del got, want
    _float32_batch.cache_clear()
    worst = {f"{r['kernel']}/{r['dtype']}": 0.0 for r in rows}
    for r in rows:
        worst[f"{r['kernel']}/{r['dtype']}"] = max(worst[f"{r['kernel']}/{r['dtype']}"], r["max_abs_error"])
    return {"passed": all(r["ok"] for r in rows), "cases": len(rows), "failures": sum(not r["ok"] for r in rows),
            "worst_error": worst, "rows": rows}
