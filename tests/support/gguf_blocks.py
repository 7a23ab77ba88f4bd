"""Random GGUF blocks of every format the native kernels read (vmesh.kernels.cpu_native's
QUANTIZED_FORMATS), for the kernels' tests and benchmarks/integer_linear.py."""

from __future__ import annotations

import numpy as np

from vmesh.kernels.cpu_native import QUANTIZED_FORMATS

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
FORMATS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
# Each format's float16 fields: (byte offset in the block, range of values), sized like a real
# model's; every other byte (codes, packed scales) is random.
FLOAT16_FIELDS = {Q4_0: [(0, (0.001, 0.05))], Q4_1: [(0, (0.001, 0.05)), (2, (-0.2, 0.2))],
                  Q5_0: [(0, (0.001, 0.05))], Q8_0: [(0, (0.001, 0.05))],
                  Q4_K: [(0, (0.0005, 0.003)), (2, (0.0005, 0.003))], Q6_K: [(208, (0.0005, 0.003))]}


def random_blocks(block_format: int, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, row bytes]: random codes with scales (and offsets) of a real model's size."""
    rng = np.random.default_rng(seed)
    geometry = QUANTIZED_FORMATS[block_format]
    blocks = out_features * in_features // geometry.block_values
    raw = rng.integers(0, 256, size=(blocks, geometry.block_bytes), dtype=np.uint8)
    for at, (low, high) in FLOAT16_FIELDS[block_format]:
        raw[:, at:at + 2] = rng.uniform(low, high, blocks).astype(np.float16)[:, None].view(np.uint8)
    return raw.reshape(out_features, -1)
