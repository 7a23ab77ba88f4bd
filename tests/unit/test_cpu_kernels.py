"""The C attention kernels (per token and tiled prefill) against the torch reference, its build cache and its
fallbacks; oneDNN-packed linears against F.linear."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.support.paged import ragged_batch
from vmesh.kernels import cpu_native, reference
from vmesh.kernels.cpu_native import CpuKernelBuildError
from vmesh.services.worker.attention import CpuAttentionBackend, TorchAttentionBackend, make_attention_backend
from vmesh.services.worker.linear import Linear, onednn_packing_usable, packed_layout

CASES = [  # (head_dim, heads, kv_heads, block_size): the specialised sizes and the generic path
    (64, 9, 3, 16),   # the default model: GQA ratio 3
    (64, 4, 4, 1),    # MHA, one token per block
    (128, 8, 1, 32),  # MQA
    (80, 6, 2, 16),   # a head_dim with no specialisation (the generic 16-lane path)
    (64, 10, 2, 16),  # a group of 5: query heads in a set of 4 and a set of 1
    (256, 4, 1, 16),  # Gemma 3's head_dim: one query head's sums at a time
    (40, 4, 2, 16),   # not a multiple of 16: the scalar path
]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size"), CASES)
def test_decode_attention_matches_reference(kernels, head_dim, heads, kv_heads, block_size):
    # Contexts of one token, ending on and just past a block boundary, and long ones.
    context_lens = [0, block_size - 1, block_size, 70, 300]
    q, kc, vc, starts, seq_lens, tables = ragged_batch([1] * len(context_lens), context_lens, heads, kv_heads,
                                                       head_dim, block_size, torch.float32, seed=head_dim)
    scale = head_dim ** -0.5
    out = torch.zeros_like(q)
    rows = torch.arange(len(context_lens))
    kernels.paged_attention(q, kc, vc, kernels.attention_items(tables, rows, rows, seq_lens), scale, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_decode_attention_writes_only_the_given_rows_of_a_mixed_batch(kernels):
    """Decodes sit among prefill chunks: request rows and token rows differ, the query is a
    strided view (q split from a fused qk tensor), and other rows of `out` stay untouched."""
    query_lens, context_lens = [4, 1, 3, 1], [5, 40, 0, 17]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, 6, 2, 64, 16, torch.float32, seed=3)
    fused = torch.cat([q, torch.randn(q.shape[0], 2, 64)], dim=1)
    q_view = fused[:, :6]
    assert not q_view.is_contiguous()
    out = torch.full_like(q, 7.0)
    request_rows = torch.tensor([1, 3])
    token_rows = starts[request_rows].long()
    items = kernels.attention_items(tables, request_rows, token_rows, seq_lens[request_rows])
    kernels.paged_attention(q_view, kc, vc, items, 0.125, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125)
    torch.testing.assert_close(out[token_rows], want[token_rows], atol=2e-5, rtol=2e-5)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[token_rows] = False
    assert bool((out[others] == 7.0).all())


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size"), [CASES[0], CASES[-1]])
def test_prefill_chunks_attend_causally_token_by_token(kernels, head_dim, heads, kv_heads, block_size):
    """A chunk of n query tokens is n items, token j seeing the cached context plus the
    chunk's first j + 1 tokens."""
    query_lens, context_lens = [5, 1, 33, 2], [0, 12, 17, 40]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                       block_size, torch.float32, seed=11)
    request_rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    token_rows = torch.arange(q.shape[0])
    ends = starts[1:].long()
    context = (seq_lens.long()[request_rows] - (ends[request_rows] - 1 - token_rows)).int()
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    kernels.paged_attention(q, kc, vc, kernels.attention_items(tables, request_rows, token_rows, context), scale, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_attention_rejects_wrong_dtypes_and_layouts(kernels):
    q, kc, vc, _, seq_lens, tables = ragged_batch([1], [3], 4, 2, 64, 16, torch.float32)
    rows = torch.arange(1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.attention_items(tables.long(), rows, rows, seq_lens)
    with pytest.raises(ValueError, match="one entry per query token"):
        kernels.attention_items(tables, rows, rows, seq_lens.repeat(2))
    items = kernels.attention_items(tables, rows, rows, seq_lens)
    with pytest.raises(ValueError, match="key_cache"):
        kernels.paged_attention(q, kc.transpose(1, 2), vc, items, 0.1, out)
    with pytest.raises(ValueError, match="query"):
        kernels.paged_attention(q.half(), kc, vc, items, 0.1, out)


def _prefill_chunks(kernels, query_lens, starts, seq_lens, tables, rows=None):
    rows = torch.arange(len(query_lens)) if rows is None else torch.as_tensor(rows)
    lengths = torch.tensor(query_lens, dtype=torch.int32)[rows]
    return kernels.prefill_chunks(tables, rows, starts[rows].long(), lengths, seq_lens[rows])


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size"), CASES[:4])
def test_tiled_prefill_attention_matches_reference(kernels, head_dim, heads, kv_heads, block_size):
    """Several chunks per call, of one token to more than a tile, from an empty context and
    after cached tokens, starting and ending on and off block edges."""
    query_lens, context_lens = [5, 1, 33, 2, 17, 100], [0, 12, 17, 40, 15, 32]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                       block_size, torch.float32, seed=11)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    kernels.prefill_attention(q, kc, vc, _prefill_chunks(kernels, query_lens, starts, seq_lens, tables), scale, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("query_lens", "context_lens", "heads", "kv_heads"), [
    ([4096], [0], 2, 1),                     # a whole 4,096-token prompt
    ([1000, 7], [3096, 0], 2, 1),            # a chunk after a context that ends mid-block, beside a short one
    ([2000], [0], 9, 3),                     # the default model's heads
    ([512, 512, 333], [1536, 0, 701], 9, 3), # several long chunks in one step, on and off block edges
])
def test_tiled_prefill_attention_on_long_contexts(kernels, query_lens, context_lens, heads, kv_heads):
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, heads, kv_heads, 64, 16,
                                                       torch.float32, seed=len(query_lens))
    out = torch.empty_like(q)
    kernels.prefill_attention(q, kc, vc, _prefill_chunks(kernels, query_lens, starts, seq_lens, tables), 0.125, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_tiled_prefill_attention_writes_only_its_chunks_rows(kernels):
    query_lens, context_lens = [4, 1, 40, 1], [5, 40, 0, 17]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, 6, 2, 64, 16, torch.float32, seed=3)
    q_view = torch.cat([q, torch.randn(q.shape[0], 2, 64)], dim=1)[:, :6]  # a strided view, as from fused qkv
    out = torch.full_like(q, 7.0)
    kernels.prefill_attention(q_view, kc, vc, _prefill_chunks(kernels, query_lens, starts, seq_lens, tables, [0, 2]),
                              0.125, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125)
    mine = torch.cat([torch.arange(0, 4), torch.arange(5, 45)])
    torch.testing.assert_close(out[mine], want[mine], atol=2e-5, rtol=2e-5)
    assert bool((out[[4, 45]] == 7.0).all())


@pytest.mark.parametrize(("heads", "kv_heads", "key_scale"), [(9, 3, 30.0), (192, 1, 1.0)])
def test_tiled_prefill_attention_on_peaked_scores_and_wide_groups(kernels, heads, kv_heads, key_scale):
    """Keys scaled up make scores of hundreds: the running maximum jumps between key tiles and
    most exponentials underflow. 192 query heads on one KV head make a tile of one token."""
    query_lens, context_lens = [130, 3], [70, 0]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, heads, kv_heads, 64, 16,
                                                       torch.float32, seed=7)
    kc *= key_scale
    out = torch.empty_like(q)
    kernels.prefill_attention(q, kc, vc, _prefill_chunks(kernels, query_lens, starts, seq_lens, tables), 0.125, out)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_attention_kernels_refuse_work_beyond_their_tensors(kernels):
    q, kc, vc, starts, seq_lens, tables = ragged_batch([3, 2], [2, 0], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="must index block_tables"):
        kernels.prefill_chunks(tables, torch.tensor([0, 2]), starts[:-1].long(),
                               torch.tensor([3, 2], dtype=torch.int32), seq_lens)
    chunks = _prefill_chunks(kernels, [3, 2], starts, seq_lens, tables)
    with pytest.raises(ValueError, match="reaches query row 4"):
        kernels.prefill_attention(q[:4], kc, vc, chunks, 0.1, torch.empty_like(q[:4]))
    with pytest.raises(ValueError, match="do not fit query"):
        kernels.prefill_attention(q, kc, vc[:, :, :1].contiguous(), chunks, 0.1, torch.empty_like(q))
    rows = torch.arange(2)
    items = kernels.attention_items(tables, rows, rows, torch.tensor([5, 400], dtype=torch.int32))
    with pytest.raises(ValueError, match="context 400"):
        kernels.paged_attention(q, kc, vc, items, 0.1, torch.empty_like(q))


def test_tiled_prefill_attention_refuses_bad_chunks_and_head_sizes(kernels):
    q, kc, vc, starts, seq_lens, tables = ragged_batch([3], [2], 4, 2, 40, 16, torch.float32)
    with pytest.raises(ValueError, match="length <= seq_len"):
        _prefill_chunks(kernels, [6], starts, seq_lens, tables)
    chunks = _prefill_chunks(kernels, [3], starts, seq_lens, tables)
    assert not kernels.supports_prefill(kc)
    with pytest.raises(ValueError, match="head_dim 40"):
        kernels.prefill_attention(q, kc, vc, chunks, 0.1, torch.empty_like(q))


@pytest.mark.parametrize("head_dim", [64, 40])
def test_cpu_backend_matches_torch_backend_on_a_mixed_batch(kernel_cache_dir, monkeypatch, head_dim):
    """Decodes and chunks of every kind in one step: decodes go to the per-token kernel, chunks
    to the tiled one; where the tiled kernel cannot take the head size, every query token of
    every chunk is an item of the per-token kernel."""
    from vmesh.services.worker.attention import AttentionMetadata

    query_lens, context_lens = [1, 6, 1, 1, 3, 70, 6], [31, 0, 2, 64, 20, 9, 5]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, 9, 3, head_dim, 16, torch.float32,
                                                       seed=5)

    def meta():
        return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=starts,
                                 seq_lens=seq_lens, block_tables=tables, query_lens_cpu=query_lens,
                                 seq_lens_cpu=seq_lens.tolist())

    cpu = CpuAttentionBackend(kernel_cache_dir)
    calls: dict[str, list[int]] = {"items": [], "chunks": []}
    per_token, tiled = cpu.kernels.paged_attention, cpu.kernels.prefill_attention
    monkeypatch.setattr(cpu.kernels, "paged_attention", lambda query, kc, vc, items, *rest: calls["items"].append(
        items.token_rows.numel()) or per_token(query, kc, vc, items, *rest))
    monkeypatch.setattr(cpu.kernels, "prefill_attention", lambda query, kc, vc, chunks, *rest: calls["chunks"].append(
        chunks.requests.numel()) or tiled(query, kc, vc, chunks, *rest))
    got = cpu.attend(q, kc, vc, meta(), 0.125)
    assert calls == ({"items": [3], "chunks": [4]} if head_dim == 64 else {"items": [sum(query_lens)], "chunks": []})
    want = TorchAttentionBackend().attend(q, kc, vc, meta(), 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_build_is_cached_per_source_and_compiler(kernel_cache_dir):
    # kernel_cache_dir holds this run's one build (or warm-cache's, copied): found, not built again.
    first = cpu_native._build(kernel_cache_dir)
    stamp = first.stat().st_mtime_ns
    assert cpu_native._build(kernel_cache_dir) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging leftovers


def test_missing_or_failing_compiler_is_a_clear_error_and_auto_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-vmesh")
    with pytest.raises(CpuKernelBuildError, match="no-such-compiler-vmesh"):
        cpu_native._build(tmp_path)
    monkeypatch.setenv("CC", "false")  # found, but fails to compile
    with pytest.raises(CpuKernelBuildError, match="failed"):
        cpu_native._build(tmp_path / "other")
    with caplog.at_level(logging.WARNING):
        backend = make_attention_backend("auto", torch.device("cpu"), tmp_path / "third")
    assert backend.name == "torch"
    assert "CPU attention kernel unavailable" in caplog.text
    with pytest.raises(CpuKernelBuildError):
        make_attention_backend("cpu", torch.device("cpu"), tmp_path / "fourth")


@pytest.mark.parametrize("rows", [1, 3, 64, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    layer = Linear(weight, bias)
    assert layer.packed == onednn_packing_usable(weight)
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, rows, 40, generator=g)[:, :, :]
    torch.testing.assert_close(layer(x3), F.linear(x3, weight, bias), atol=1e-5, rtol=1e-5)
    plain = Linear(weight, bias, pack=False)
    assert not plain.packed
    torch.testing.assert_close(plain(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [0, 1, 2, 4, 5, 6, 7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_small_batch_linear_matches_f_linear(kernels, rows, with_bias, pack, monkeypatch):
    """Packed, the small-batch kernel reads oneDNN's copy (no plain weight kept) where the layout
    check accepts it; unpacked, the plain weight, up to the kernels' stream_rows (a speculative step's
    1 + k rows), oneDNN beyond. 300 x 72 pads both dimensions of the blocks; beyond 4 rows a packed
    block is taken in halves, and a thread's partial block group by group."""
    g = torch.Generator().manual_seed(10 + rows)
    weight = torch.randn(300, 72, generator=g)
    bias = torch.randn(300, generator=g) if with_bias else None
    layer = Linear(weight, bias, pack=pack, small_batch_kernels=kernels)
    reads_packed = layer.weight is None
    assert reads_packed == (pack and packed_layout(weight, layer._packed) is not None)
    kernel = "packed_small_batch_linear_f32" if reads_packed else "small_batch_linear_f32"
    calls, original = [], kernels._functions[kernel]
    monkeypatch.setitem(kernels._functions, kernel, lambda *a: calls.append(a[4]) or original(*a))
    x = torch.randn(rows, 72, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(1, rows, 72, generator=g)
    torch.testing.assert_close(layer(x3), F.linear(x3, weight, bias), atol=1e-5, rtol=1e-5)
    assert calls == ([rows, rows] if rows <= kernels.stream_rows else [])
