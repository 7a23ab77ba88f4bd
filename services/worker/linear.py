"""Linear layers with the weight laid out once, at load time, for the device's fastest kernel.

On CPU, torch's default `F.linear` goes through MKL, which on this project's AMD machines
reaches ~106 GFLOP/s at the default model's batch-64 shapes and ~12 GB/s for single-row
products. oneDNN with a weight reordered into its blocked layout reaches ~190 GFLOP/s and
~22 GB/s on the same shapes, and the tied LM head runs 1.8x (64 rows) to 2.4x (1 row)
faster (measured 2026-11-29; `benchmarks/README.md`). inductor uses the same two ops for
frozen CPU linears. Elsewhere (CUDA) `F.linear` is already the fast path.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for an expected row count; one layout serves every row
# count well (1 to 200 rows measured), and this hint was the best of 1, 64 and 256.
PACKING_ROWS_HINT = 64


def onednn_packing_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x @ weight.T + bias, for x of any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if pack and onednn_packing_usable(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_ROWS_HINT)
                self.weight = None  # the packed copy replaces it
            except RuntimeError as exc:  # an unusual torch build: fall back, loudly
                logger.warning("oneDNN weight packing failed (%s); using F.linear", exc)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._packed, self.bias,
                                                 "none", [], "")
        return out.view(*lead, self.out_features)
