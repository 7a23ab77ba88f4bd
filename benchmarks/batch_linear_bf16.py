"""bfloat16 linears of a few dozen rows: vmesh/kernels/cpu/batch_linear_bf16.c (AVX-512 BF16 dot
products) against oneDNN, over the same packed weight, per layer of the default model and row count.

    .venv/bin/python -m benchmarks.batch_linear_bf16 [--rows 8 16 32 64 128] [--threads 2] [--rounds 21]

Each layer's weight (random, the model's shape) is packed once as Linear packs it; each row count's
two products alternate call by call (the machine drifts), and the medians are compared. The
weights are hot in the caches here, as they are not in a decoder step: the step's own figure comes
from `benchmarks.decode_step --dtype bfloat16 --baseline-ref REF`. The outputs are checked against
a float32 product first. On a CPU without AVX-512 BF16, or where oneDNN packs AMX's 32-wide layout,
there is nothing to compare and the script says so.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks.linear_packing import model_shapes
from vmesh.kernels.cpu_native import load_cpu_kernels
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.worker.linear import PACKED_OUT_BLOCK, PACKING_ROWS_HINT, packed_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(default_cache_dir())
    if not kernels.bf16_dot:
        raise SystemExit("the kernels were built without AVX-512 BF16 on this CPU: oneDNN serves every row count")
    torch.manual_seed(0)
    print(f"{'layer':>8} {'rows':>5} {'oneDNN us':>10} {'C us':>9} {'C / oneDNN':>10} {'C GFLOP/s':>10}")
    for name, (out_features, in_features) in model_shapes().items():
        weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
        layout = packed_layout(weight, packed)
        if layout is None or layout.out_block != PACKED_OUT_BLOCK:
            raise SystemExit("oneDNN packs another layout on this CPU (AMX's): the C kernel does not serve it")
        address = torch.ops.mkldnn.data_ptr(packed)
        for rows in args.rows:
            x = torch.randn(rows, in_features).bfloat16()
            want = x.float() @ weight.float().T
            got = kernels.packed_batch_linear_bf16(x, address, out_features, layout.padded_in, None)
            torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2.0 ** -7)
            calls = {
                "oneDNN": functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
                "C": functools.partial(kernels.packed_batch_linear_bf16, x, address, out_features, layout.padded_in,
                                       None),
            }
            samples: dict[str, list[float]] = {kind: [] for kind in calls}
            for _ in range(args.rounds):
                for kind, call in calls.items():
                    start = time.perf_counter()
                    call()
                    samples[kind].append(time.perf_counter() - start)
            onednn, ours = (statistics.median(samples[kind]) for kind in ("oneDNN", "C"))
            gflops = 2 * rows * out_features * in_features / ours / 1e9
            print(f"{name:>8} {rows:>5} {onednn * 1e6:>10.1f} {ours * 1e6:>9.1f} {ours / onednn:>10.2f} "
                  f"{gflops:>10.0f}")


if __name__ == "__main__":
    main()
