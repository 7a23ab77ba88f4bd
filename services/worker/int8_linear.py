"""`--weights int8`: a float checkpoint's linears as int8 weights, quantized at load.

Each weight row (output feature) gets one symmetric scale, max |w| / 127, and int8 codes rounded to
nearest. Activations are rounded per call in one of two ways (`vmesh/kernels/cpu/int8_linear.c`,
AVX-512 VNNI), by how many rows the call has:
- up to BLOCK_PATH_MIN_ROWS - 1 rows (one or a few decode streams, bound by reading the weights):
  to 16 bits per row (token), each code as two bytes against the same weight byte: no measurable
  perplexity cost;
- from BLOCK_PATH_MIN_ROWS rows (prefill chunks and batches, bound by arithmetic): to 8 bits per
  block of 64 inputs (`CpuKernels.int8_block_inputs`), one integer dot product per 4 inputs and half
  the products of the 16-bit path; a block's few large values set only that block's scale (8 bits
  per token cost 3 % of perplexity; per block +0.74 %, benchmarks/README.md "int8 linears in the
  bfloat16 model"). Widths that do not divide by 64 keep the 16-bit path at every row count.
So a request's outputs depend on how many rows its step carried, as the bfloat16 mode's do (its
linears change kernels by row count too). The int8 weights are held twice, as codes [out, in] (the
16-bit path, the tied embedding's lookups) and packed for the block path: half of float32's bytes,
as bfloat16's. The mixed bfloat16 model (`--dtype bfloat16`) takes these layers too: bfloat16 in and
out.

Every linear takes it, the LM head included; a tied embedding table is then read back from the
head's int8 rows (`weight_rows`), so it too is held once, in int8.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.worker.quantized_linear import cpu_integer_kernels

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float32 scales [out]): symmetric, one scale per row, max |w| / 127."""
    values = weight.to(torch.float32)
    scale = values.abs().amax(dim=1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (values * inverse[:, None]).round().to(torch.int8).contiguous(), scale.contiguous()


# From this many rows a call rounds its activations per block (the module's docstring). Below it a
# step is one or a few decode streams, bound by reading the weights, where the 16-bit path's
# accuracy costs little time (the block path is faster even there while the weights sit in cache:
# benchmarks/int8_block_linear.py); from it the block path runs 2.5-3x the 16-bit one.
BLOCK_PATH_MIN_ROWS = 8


def pack_for_blocks(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] as the block path reads them: uint8 [ceil(out / 16), in / 4, 16, 4],
    each code offset by 128, features padded to a multiple of 16 with code 0."""
    out_features, in_features = codes.shape
    vectors = -(-out_features // 16)
    padded = torch.zeros(vectors * 16, in_features, dtype=torch.int16)
    padded[:out_features] = codes
    return (padded + 128).to(torch.uint8).view(vectors, 16, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()


def int8_kernels(device: torch.device, dtype: torch.dtype, cache_dir: Path) -> CpuKernels:
    """The kernels `--weights int8` runs on, or a ModelLoadError that says why it cannot here."""
    kernels = cpu_integer_kernels("int8", device, dtype, cache_dir, dtypes=(torch.float32, torch.bfloat16))
    if not kernels.integer_dot:
        raise ModelLoadError("--weights int8 needs AVX-512 VNNI, which this CPU lacks; use --weights dequantized")
    return kernels


class Int8Linear:
    """y = x @ W.T + bias for x of any leading shape, W held as int8 codes and per-row scales
    (Linear's interface). x float32 or bfloat16 on the CPU; the result in the weight's dtype as
    given (bfloat16 in the mixed model, whose attention hands its output over in float32)."""

    packed = False  # as Linear's: no oneDNN copy
    weight = None  # no float weight is held; weight_rows reads the codes
    rows_readable = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CpuKernels):
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"weight must be a CPU [out, in] tensor, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.out_dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        self.codes, self.scale = quantize_per_row(weight)
        self.row_sums = self.codes.sum(dim=1, dtype=torch.int32).contiguous()
        self.bias = bias.to(torch.float32).contiguous() if bias is not None else None
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(self.bias.shape)}")
        self.kernels = kernels
        # Widths that are not whole blocks keep the 16-bit path for every row count.
        self.blocks = pack_for_blocks(self.codes) if self.in_features % kernels.int8_block_inputs == 0 else None

    @property
    def kernel_description(self) -> str:
        batches = (f"; from {BLOCK_PATH_MIN_ROWS} rows 8-bit activations per block of {self.kernels.int8_block_inputs}"
                   if self.blocks is not None else "")
        return f"int8 weights per output feature x 16-bit activations per token{batches} (AVX-512 VNNI)"

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (1-D): the lookup of an embedding table tied to this layer."""
        return self.codes[ids].to(torch.float32) * self.scale[ids, None]

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 (tests and checks only; the layer never holds it)."""
        return self.codes.to(torch.float32) * self.scale[:, None]

    def held_bytes(self) -> dict[str, int]:
        blocks = self.blocks.nbytes if self.blocks is not None else 0
        return {"int8": self.codes.nbytes + self.scale.nbytes + self.row_sums.nbytes + blocks}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.blocks is not None and flat.shape[0] >= BLOCK_PATH_MIN_ROWS:
            out = self.kernels.int8_block_linear(flat.contiguous(), self.blocks, self.scale, self.bias,
                                                 self.out_dtype)
        else:
            out = self.kernels.int8_linear(flat.to(torch.float32).contiguous(), self.codes, self.scale,
                                           self.row_sums, self.bias).to(self.out_dtype)
        return out.view(*lead, self.out_features)
