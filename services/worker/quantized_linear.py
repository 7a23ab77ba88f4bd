"""Linear layers over a GGUF file's quantized blocks (`--weights native`).

A Q4_1 weight is 20 bytes per 32 values where float32 takes 128 (Q4_K 18, Q6_K 26.25), and a
single stream's decode step is a pass over every weight: keeping the file's blocks and
multiplying them directly (`vmesh/kernels/cpu/quantized_linear.c`) reads about a sixth of the bytes,
and the worker holds a sixth of the memory. No float32 copy of a whole weight is made at any point.

The file's tensors are read with the gguf package's GGUFReader and renamed to the Hugging Face
names the model expects (services/worker/gguf_names.py). Linears whose blocks the kernels read
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K: vmesh/kernels/cpu/gguf_blocks.h) stay quantized; every other tensor
(float norms, other block formats) is dequantized as in `--weights dequantized`. Parts of one
stacked linear (q, k, v) in different formats are joined when they widen exactly to Q8_0
(QuantizedWeight.join). For the Llama architecture GGUF stores q_proj/k_proj rows permuted
(llama.cpp's converter interleaves each head's rotary halves); transformers undoes that on load,
and so does this reader, on whole rows of blocks: blocks run along the input dimension, so a
row permutation of the quantized bytes is exact.

Where the CPU has AVX-512 VNNI the layers round their activations to int8 per block of 32 (one
scale each, as llama.cpp's q8 activations; a K-quant's sub-blocks of 32 each meet one) and
multiply on integer dot products (`vmesh/kernels/cpu/integer_linear.c`); elsewhere, or with
VMESH_QUANTIZED_DOT=float, they keep the float32 kernel. The load-time log says which.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
import torch

from vmesh.kernels.cpu_native import QUANTIZED_FORMATS, CpuKernelBuildError, load_cpu_kernels
from vmesh.services.common.model_loading import ModelLoadError, gguf_model_file
from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.gguf_names import NORMS_STORED_PLUS_ONE, gguf_to_hf_names

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels
    from vmesh.services.worker.int8_linear import Int8Linear
    from vmesh.services.worker.linear import Linear

logger = logging.getLogger(__name__)

def format_name(block_format: int) -> str:
    """A GGML type id's name: the kernel's formats without the gguf package, the others through it."""
    if block_format in QUANTIZED_FORMATS:
        return QUANTIZED_FORMATS[block_format].name
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(block_format).name


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out, in] as a GGUF file stores it: uint8 [out, bytes per row], each row its
    input features in blocks of `block_format` (a GGML type id)."""

    blocks: torch.Tensor
    block_format: int
    in_features: int

    def __post_init__(self) -> None:
        block_size, block_bytes = _block_geometry(self.block_format)
        if self.in_features <= 0 or self.in_features % block_size:
            raise ValueError(f"{format_name(self.block_format)} needs in_features a multiple of {block_size}, "
                             f"got {self.in_features}")
        row_bytes = self.in_features // block_size * block_bytes
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != row_bytes:
            raise ValueError(f"blocks must be uint8 [out, {row_bytes}], got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def kernel_readable(self) -> bool:
        return self.block_format in QUANTIZED_FORMATS

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], through the gguf package: the load-time fallback for a weight that
        does not stay quantized (no kernel for its format, or a float consumer)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType(self.block_format))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(self.blocks[order].contiguous(), self.block_format, self.in_features)

    def widened_to_q8_0(self) -> QuantizedWeight:
        """The same values as Q8_0 blocks, for a Q4_0 or Q5_0 weight: their (q - 8) d and (q - 16) d
        are Q8_0's code times the same d, so this is exact (at 34 bytes per block instead of 18 or 22)."""
        if self.block_format not in _WIDENS_TO_Q8_0:
            raise ValueError(f"{format_name(self.block_format)} does not widen to Q8_0 exactly")
        blocks = self.blocks.numpy().reshape(-1, _block_geometry(self.block_format)[1])
        nibbles = blocks[:, -16:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int16)
        if self.block_format == Q5_0:
            fifth = blocks[:, 2:6].copy().view(np.uint32)
            codes |= ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        widened = np.concatenate([blocks[:, :2], (codes - _WIDENS_TO_Q8_0[self.block_format]).astype(np.int8)
                                  .view(np.uint8)], axis=1)
        return QuantizedWeight(torch.from_numpy(widened.reshape(self.out_features, -1)), Q8_0, self.in_features)

    @staticmethod
    def join(parts: Sequence[torch.Tensor | QuantizedWeight]) -> QuantizedWeight | str:
        """The parts stacked by rows (q, k and v; gate and up) as one weight for the kernel, or why not.
        Parts in Q8_0 and in formats that widen to it exactly (Gemma 3's GGUF stores q and k as Q5_0,
        some layers' v as Q8_0) are joined as Q8_0."""
        formats = sorted({format_name(p.block_format) if isinstance(p, QuantizedWeight) else str(p.dtype)
                          for p in parts})
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len(quantized) == len(parts) and len(formats) > 1 and {p.block_format for p in quantized} <= {
                Q8_0, *_WIDENS_TO_Q8_0}:
            quantized = [p if p.block_format == Q8_0 else p.widened_to_q8_0() for p in quantized]
            formats = ["Q8_0"]
        if len(quantized) < len(parts) or len(formats) > 1:
            return f"stored as {' + '.join(formats)}"
        if not quantized[0].kernel_readable:
            return f"stored as {formats[0]} (no kernel for it)"
        if len({p.in_features for p in quantized}) > 1:
            return "input widths differ"
        if len(quantized) == 1:
            return quantized[0]
        return QuantizedWeight(torch.cat([p.blocks for p in quantized]), quantized[0].block_format,
                               quantized[0].in_features)


Q4_0, Q5_0, Q8_0 = 2, 6, 8  # GGML type ids
_WIDENS_TO_Q8_0 = {Q4_0: 8, Q5_0: 16}  # format: the K of its values (q - K) d


def _block_geometry(block_format: int) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    if block_format in QUANTIZED_FORMATS:
        return QUANTIZED_FORMATS[block_format].block_values, QUANTIZED_FORMATS[block_format].block_bytes
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(block_format)]


# "float" keeps the float32 kernel where the integer one would run (a CPU without VNNI keeps it anyway).
DOT_ENV = "VMESH_QUANTIZED_DOT"
_DOT_CHOICES = ("int8", "float")


def integer_dot_chosen(kernels: CpuKernels) -> bool:
    """Whether quantized layers multiply on int8 dot products: the CPU's flags (the kernels were
    built for it), unless DOT_ENV asks for the float32 kernel."""
    requested = os.environ.get(DOT_ENV, "int8")
    if requested not in _DOT_CHOICES:
        raise ValueError(f"{DOT_ENV} must be one of {', '.join(_DOT_CHOICES)}, got {requested!r}")
    return kernels.integer_dot and requested == "int8"


class QuantizedLinear:
    """y = x @ dequant(weight).T + bias, for x of any leading shape: Linear's interface over a
    QuantizedWeight in a format the C kernel reads. Float32 activations on the CPU."""

    packed = False  # as Linear's: no oneDNN copy
    weight = None  # no float weight is held; weight_rows reads the blocks
    rows_readable = True

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: CpuKernels):
        if not weight.kernel_readable:
            raise ValueError(f"no kernel reads {format_name(weight.block_format)} blocks")
        self.quantized = QuantizedWeight(weight.blocks.contiguous(), weight.block_format, weight.in_features)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bias = bias.to(torch.float32).contiguous() if bias is not None else None
        self.kernels = kernels
        self.integer = integer_dot_chosen(kernels)
        # The weight and bias checked once; each call checks its input only.
        self._product = kernels.quantized_product(self.quantized.blocks, self.quantized.block_format,
                                                  self.in_features, self.bias, integer=self.integer)

    @property
    def format(self) -> str:
        return QUANTIZED_FORMATS[self.quantized.block_format].name

    @property
    def kernel_description(self) -> str:
        """What multiplies by this weight, for the load-time log."""
        if self.integer:
            return "int8 dot products (AVX-512 VNNI), activations rounded to int8 per 32"
        return "float32 products over blocks expanded in registers"

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """dequant(weight)[ids] for 1-D ids: the lookup of an embedding table tied to this layer,
        which expands only the rows looked up."""
        q = self.quantized
        return self.kernels.quantized_rows(q.blocks, q.block_format, q.in_features, ids.to(torch.int64).contiguous())

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 (tests and checks only; the layer never holds it)."""
        return self.weight_rows(torch.arange(self.out_features))

    def held_bytes(self) -> dict[str, int]:
        return {"quantized": self.quantized.blocks.nbytes}

    def after_rms_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """self(rms_norm(x (+ residual))) and the residual stream, in one C call: CpuKernels.add_rms_norm's
        contract (float32, 2-D) for the norm (QuantizedProduct.after_rms_norm)."""
        return self._product.after_rms_norm(x, norm_weight, eps, residual)

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)) in one C call (float32, 2-D)."""
        return self._product.after_silu_and_mul(gate_up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the decoder's rows: no reshapes (each costs about a microsecond)
            return self._product(x.contiguous())
        lead = x.shape[:-1]
        return self._product(x.reshape(-1, self.in_features).contiguous()).view(*lead, self.out_features)



def is_plain_quantized(linear: object) -> TypeGuard[QuantizedLinear]:
    """A QuantizedLinear itself, not a wrapper of one (a LoRA layer reads its own input): the
    linears that may take the elementwise op before them into their own C call."""
    return type(linear) is QuantizedLinear

def read_gguf_weights(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The file's tensors under Hugging Face names, owned (copied out of the file's mapping):
    float tensors as float tensors, quantized ones as QuantizedWeight, whatever their format
    (the model decides which stay quantized). Llama's q/k rows are un-permuted as transformers does."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    field = reader.fields.get("general.architecture")
    architecture = str(field.contents()) if field is not None else ""
    names = gguf_to_hf_names(architecture, spec)
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    skipped = []
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if name is None:
            skipped.append(tensor.name)
            continue
        kind = GGMLQuantizationType(tensor.tensor_type)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            if kind == GGMLQuantizationType.BF16:  # numpy has no bfloat16: the gguf package widens it
                from gguf.quants import dequantize

                floats = torch.from_numpy(dequantize(tensor.data, kind).copy())
            else:
                floats = torch.from_numpy(np.array(tensor.data))
            if architecture in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
                floats -= 1
            value: torch.Tensor | QuantizedWeight = floats
        else:
            # GGUF lists dimensions innermost first: shape[0] is the input width.
            value = QuantizedWeight(torch.from_numpy(np.array(tensor.data)), int(kind), int(tensor.shape[0]))
        if architecture == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
            order = gguf_rows_in_hf_order(_rows(value), heads)
            value = value.permute_rows(order) if isinstance(value, QuantizedWeight) else value[order].contiguous()
        tensors[name] = value
    if skipped:
        logger.info("GGUF tensors not used by the model: %s", ", ".join(skipped))
    return tensors


def _rows(value: torch.Tensor | QuantizedWeight) -> int:
    return value.out_features if isinstance(value, QuantizedWeight) else value.shape[0]


def gguf_rows_in_hf_order(rows: int, heads: int) -> torch.Tensor:
    """Indices into a GGUF q/k weight's rows giving the Hugging Face order. llama.cpp's converter
    stores each head's rows [first half | second half] interleaved (row 2i from the first half,
    2i + 1 from the second); transformers' LlamaTensorProcessor reshapes [heads, dim/2, 2] and
    swaps the last two axes back, which is this gather."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def load_native_weights(model: str | None, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                        cache_dir: Path) -> tuple[dict[str, torch.Tensor | QuantizedWeight], CpuKernels]:
    """`--weights native`: the GGUF file's tensors and the kernels that read them, or a
    ModelLoadError that says why this model or device cannot."""
    path = gguf_model_file(model, cache_dir)
    if path is None:
        raise ModelLoadError(f"--weights native reads a GGUF file's quantized blocks, and {model} is a Hugging Face "
                             "directory; use --weights dequantized (the default) for it")
    kernels = cpu_integer_kernels("native", device, dtype, cache_dir)
    return read_gguf_weights(path, spec), kernels


def cpu_integer_kernels(mode: str, device: torch.device, dtype: torch.dtype, cache_dir: Path,
                        dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> CpuKernels:
    """The C kernels a `--weights {mode}` model runs on (both integer modes run there, `native` in
    float32 and `int8` in float32 or the mixed bfloat16 model), or a ModelLoadError that says why
    they cannot run here."""
    if device.type != "cpu" or dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelLoadError(f"--weights {mode} runs on the CPU in {names} (got {device.type}, {dtype}); "
                             "use --weights dequantized")
    try:
        return load_cpu_kernels(cache_dir)
    except CpuKernelBuildError as exc:
        raise ModelLoadError(f"--weights {mode} needs the C kernels of vmesh/kernels/cpu: {exc}") from exc


def log_placement(linears: Sequence[Linear | QuantizedLinear | Int8Linear], dequantized: dict[str, str]) -> None:
    """Once per load: how many linears read quantized blocks (and in which formats), and which
    were dequantized and why."""
    quantized = [layer for layer in linears if isinstance(layer, QuantizedLinear)]
    formats = Counter(layer.format for layer in quantized)
    paths = sorted({layer.kernel_description for layer in quantized})
    logger.info("native GGUF weights: %d of %d linears read quantized blocks (%s; %s)%s", len(quantized),
                len(linears), ", ".join(f"{name} x{count}" for name, count in sorted(formats.items())) or "none",
                " + ".join(paths) or "no kernel",
                "" if not dequantized else "; dequantized to float32: " + "; ".join(
                    f"{names} ({why})" for names, why in dequantized.items()))
