"""The C kernel that applies a grammar's packed token bitmask (vmesh/kernels/cpu/token_bitmask.c): bit
for bit what xgrammar's own kernel writes, over random, whole-word and mixed masks, vocabularies
that end mid-word, chosen rows and rows strided apart; and the sampler masks with it."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from tests.support.factories import make_sampling_batch
from vmesh.services.common.structured import apply_token_bitmask
from vmesh.services.worker.sampler import Sampler


def mixed_bitmask(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Words all allowed, all refused and random, as a JSON grammar's masks mix them."""
    words = (vocab + 31) // 32
    random_words = torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int64, generator=generator).to(torch.int32)
    kind = torch.randint(0, 3, (rows, words), generator=generator)
    return torch.where(kind == 0, torch.full_like(random_words, -1),
                       torch.where(kind == 1, torch.zeros_like(random_words), random_words))


def xgrammar_masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    xgrammar.apply_token_bitmask_inplace(out, bitmask, vocab_size=logits.shape[1], indices=rows)
    return out


@pytest.mark.parametrize("vocab", [32, 300, 49152, 49155])
@pytest.mark.parametrize("rows", [None, [0], [3, 1], []], ids=["all", "first", "two", "none"])
def test_masks_exactly_as_xgrammar_does(kernels, vocab: int, rows: list[int] | None) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=generator)
    logits[0, :3] = torch.tensor([float("-inf"), float("inf"), float("nan")])
    bitmask = mixed_bitmask(4, vocab, generator)
    want = xgrammar_masked(logits, bitmask, rows)
    kernels.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits.isnan(), want.isnan())
    assert torch.equal(logits.nan_to_num(0.0), want.nan_to_num(0.0))


def test_rows_strided_apart_leave_the_gaps_alone(kernels) -> None:
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 400, generator=generator)
    logits = wide[:, :300]  # rows 400 floats apart, as a slice of a wider tensor
    wide_mask = mixed_bitmask(3, 600, generator)
    bitmask = wide_mask[:, :10]  # 10 words per row, rows 19 words apart
    want = xgrammar_masked(logits.contiguous(), bitmask.contiguous(), [0, 2])
    before = wide.clone()
    kernels.apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits, want)
    assert torch.equal(wide[:, 300:], before[:, 300:]) and torch.equal(wide[1], before[1])


def test_refuses_what_it_cannot_mask(kernels) -> None:
    logits, bitmask = torch.zeros(2, 64), torch.full((2, 2), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows must lie in"):
        kernels.apply_token_bitmask(logits, bitmask, [2])
    with pytest.raises(ValueError, match="rows must lie in"):
        kernels.apply_token_bitmask(logits, bitmask, [-1])
    with pytest.raises(ValueError, match="does not cover 65 logits"):
        kernels.apply_token_bitmask(torch.zeros(2, 65), bitmask)
    with pytest.raises(ValueError, match="does not cover 3 logits rows"):
        kernels.apply_token_bitmask(torch.zeros(3, 64), bitmask)
    with pytest.raises(ValueError, match="float32"):
        kernels.apply_token_bitmask(logits.double(), bitmask)
    with pytest.raises(ValueError, match="int32"):
        kernels.apply_token_bitmask(logits, bitmask.long())


def test_apply_token_bitmask_takes_the_kernel_for_float32_only(kernels) -> None:
    generator = torch.Generator().manual_seed(3)
    bitmask = mixed_bitmask(2, 100, generator)
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: xgrammar's kernel, the same result
        logits = torch.randn(2, 100, generator=generator).to(dtype)
        want = xgrammar_masked(logits, bitmask, [1])
        apply_token_bitmask(logits, bitmask, [1], kernels)
        assert torch.equal(logits, want)


@pytest.mark.parametrize("temperature", [0.0, 1.5], ids=["greedy", "temperature"])
def test_the_sampler_with_the_kernel_samples_as_without_it(kernels, temperature: float) -> None:
    rows, vocab = 4, 1000
    generator = torch.Generator().manual_seed(11)
    for trial in range(20):
        logits = torch.randn(rows, vocab, generator=generator) * 4
        bitmask = mixed_bitmask(rows, vocab, generator)
        outputs = []
        for sampler in (Sampler(), Sampler(kernels)):
            batch = make_sampling_batch(rows, temperature=torch.full((rows,), temperature), token_bitmask=bitmask,
                                        bitmask_rows=[0, 2, 3], generators=[torch.Generator() for _ in range(rows)],
                                        seeds=[trial] * rows)
            outputs.append(sampler(logits.clone(), batch).token_ids)
        assert torch.equal(outputs[0], outputs[1]), f"trial {trial}"
