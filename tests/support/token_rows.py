"""Rows of token ids as the worker's batch holds them, for the speculative proposers' tests."""

from __future__ import annotations

import torch


def token_rows(*seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows, width] tokens, [rows] lengths): each row's tokens first, then junk (99) to the width."""
    width = max(map(len, seqs)) + 3
    tokens = torch.full((len(seqs), width), 99, dtype=torch.int64)
    for r, seq in enumerate(seqs):
        tokens[r, :len(seq)] = torch.tensor(seq)
    return tokens, torch.tensor([len(s) for s in seqs])
