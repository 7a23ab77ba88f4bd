"""`--weights int8`: a float checkpoint's linears as int8 weights, quantized at load.

Each weight row (output feature) gets one symmetric scale, max |w| / 127, and int8 codes rounded to
nearest; each call rounds the activations to 16 bits the same way per row (token), so a product is
one integer dot over the whole input width (`vmesh/kernels/cpu/int8_linear.c`, AVX-512 VNNI: each 16-bit
code as two bytes against the same weight byte) scaled once. 16-bit activations per token cost no
measurable perplexity where 8-bit ones per token cost 3 %. The weights take a quarter of float32's
bytes, which 1-4 row decoding is bound by, and a batch's products run on integer dot products.

Every linear takes it, the LM head included; a tied embedding table is then read back from the
head's int8 rows (`weight_rows`), so it too is held once, in int8.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.worker.quantized_linear import cpu_float32_kernels

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float32 scales [out]): symmetric, one scale per row, max |w| / 127."""
    values = weight.to(torch.float32)
    scale = values.abs().amax(dim=1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (values * inverse[:, None]).round().to(torch.int8).contiguous(), scale.contiguous()


def int8_kernels(device: torch.device, dtype: torch.dtype, cache_dir: Path) -> CpuKernels:
    """The kernels `--weights int8` runs on, or a ModelLoadError that says why it cannot here."""
    kernels = cpu_float32_kernels("int8", device, dtype, cache_dir)
    if not kernels.integer_dot:
        raise ModelLoadError("--weights int8 needs AVX-512 VNNI, which this CPU lacks; use --weights dequantized")
    return kernels


class Int8Linear:
    """y = x @ W.T + bias for x of any leading shape, W held as int8 codes and per-row scales
    (Linear's interface). Float32 activations on the CPU."""

    packed = False  # as Linear's: no oneDNN copy
    weight = None  # no float weight is held; weight_rows reads the codes
    rows_readable = True
    kernel_description = "int8 weights per output feature x 16-bit activations per token (AVX-512 VNNI)"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CpuKernels):
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"weight must be a CPU [out, in] tensor, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.codes, self.scale = quantize_per_row(weight)
        self.row_sums = self.codes.sum(dim=1, dtype=torch.int32).contiguous()
        self.bias = bias.to(torch.float32).contiguous() if bias is not None else None
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(self.bias.shape)}")
        self.kernels = kernels

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (1-D): the lookup of an embedding table tied to this layer."""
        return self.codes[ids].to(torch.float32) * self.scale[ids, None]

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 (tests and checks only; the layer never holds it)."""
        return self.codes.to(torch.float32) * self.scale[:, None]

    def held_bytes(self) -> dict[str, int]:
        return {"int8": self.codes.nbytes + self.scale.nbytes + self.row_sums.nbytes}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = self.kernels.int8_linear(flat, self.codes, self.scale, self.row_sums, self.bias)
        return out.view(*lead, self.out_features)
