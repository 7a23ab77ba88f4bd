"""Linear layers with the weight laid out once, at load time, for the device's fastest kernel.

On CPU, torch's default `F.linear` goes through MKL, which on this project's AMD machines
reaches ~106 GFLOP/s at the default model's batch-64 shapes and ~12 GB/s for single-row
products. oneDNN with a weight reordered into its blocked layout reaches ~190 GFLOP/s and
~22 GB/s on the same shapes, and the tied LM head runs 1.8x (64 rows) to 2.4x (1 row)
faster (measured 2026-11-29; `benchmarks/README.md`). inductor uses the same two ops for
frozen CPU linears. Elsewhere (CUDA) `F.linear` is already the fast path.

For one to four rows (single streams, small batches) the layer is a pass over its weights,
and the plain row-major pass of `kernels/cpu/small_batch_linear.c` streams them ~1.5x faster
than oneDNN. Using it keeps the plain weight beside the packed one: the price is a second
copy of the weights in memory (the tied LM head shares the embedding table, so it costs
nothing there).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.cpu_native import CpuKernels

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for an expected row count; one layout serves every row
# count well (1 to 200 rows measured), and this hint was the best of 1, 64 and 256.
PACKING_ROWS_HINT = 64
# Up to this many rows the small-batch kernel beats oneDNN (measured: 1.6x at 1 row, 1.2x at
# 4, 0.8x at 8).
SMALL_BATCH_ROWS = 4


def onednn_packing_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x @ weight.T + bias, for x of any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 small_batch_kernels: CpuKernels | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        self.weight: torch.Tensor | None = weight.contiguous()
        self._small_batch = (small_batch_kernels if weight.dtype == torch.float32 and weight.device.type == "cpu"
                             else None)
        self._packed: torch.Tensor | None = None
        if pack and onednn_packing_usable(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACKING_ROWS_HINT)
            except RuntimeError as exc:  # an unusual torch build: fall back, loudly
                logger.warning("oneDNN weight packing failed (%s); using F.linear", exc)
        if self._packed is not None and self._small_batch is None:
            self.weight = None  # the packed copy replaces it

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self._small_batch is not None and x.shape[0] <= SMALL_BATCH_ROWS and x.dtype == torch.float32:
            out = self._small_batch.small_batch_linear(x.contiguous(), self.weight, self.bias)
        elif self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.weight, self.bias)
        return out.view(*lead, self.out_features)
