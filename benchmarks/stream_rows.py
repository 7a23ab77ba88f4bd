"""The linear kernels at a few rows against another build of them: this tree's vmesh/kernels/cpu and a
baseline tree's (`--baseline`, e.g. a checkout of the commit before a kernel change), same run.

For the embedded model's layer shapes, each path (`--weights native`'s int8 dot products and float32
block expansion over Q4_1 layers and the Q8_0 tied head, `--weights dequantized`'s float32 Linear:
the streaming C kernel or oneDNN) is timed at each row count with both builds, alternating in
`--rounds` rounds; the median per call is reported with the ratio new / baseline. One thread, the
clock is the thread's CPU time (a shared machine's descheduling does not count).

    .venv/bin/python -m benchmarks.stream_rows --baseline /path/to/other/checkout [--rows 1 4 5 8]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.integer_linear import MODEL_SHAPES, median_call
from tests.support.gguf_blocks import random_blocks
from vmesh.kernels.cpu_native import CpuKernels, load_cpu_kernels
from vmesh.services.common.model_loading import cache_dir_path
from vmesh.services.worker.linear import Linear

Q4_1, Q8_0 = 3, 8  # the embedded GGUF's layers and its tied embedding


def baseline_kernels(tree: Path, cache_dir: Path) -> CpuKernels:
    """The kernels of another tree's vmesh/kernels/cpu, built by that tree's own loader. A build from before
    kernel_limits.h stated STREAM_ROWS leaves stream_rows unset: its Linear streamed 1-4 rows."""
    # vmesh/kernels/ holds the kernels from e38d7c9 on, and was a link to the top-level kernels/ before.
    loader = next(path for path in (tree / "vmesh" / "kernels" / "cpu_native.py", tree / "kernels" / "cpu_native.py")
                  if path.is_file())
    spec = importlib.util.spec_from_file_location("baseline_cpu_native", loader)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernels = CpuKernels(ctypes.CDLL(str(module._build(cache_dir))))
    kernels.stream_rows = kernels.stream_rows or 4
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a tree whose vmesh/kernels/cpu is the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 6, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache_dir = cache_dir_path(None)
    builds = {"new": load_cpu_kernels(cache_dir), "baseline": baseline_kernels(args.baseline, cache_dir)}
    results = []
    for name, out_features, in_features in MODEL_SHAPES["smollm2"]:
        block_format = Q8_0 if name == "lm_head" else Q4_1
        blocks = torch.from_numpy(random_blocks(block_format, out_features, in_features))
        weight = builds["new"].quantized_rows(blocks, block_format, in_features, torch.arange(out_features))
        dense = {build: Linear(weight, small_batch_kernels=kernels) for build, kernels in builds.items()}
        del weight
        calls = max(2, args.calls // 20) if name == "lm_head" else args.calls
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            paths: dict[tuple[str, str], Callable[[], object]] = {}
            for build, kernels in builds.items():
                product = functools.partial(kernels.quantized_linear, x, blocks, block_format, in_features, None)
                paths["integer", build] = functools.partial(product, integer=True)
                paths["float_blocks", build] = product
                paths["f32_linear", build] = functools.partial(dense[build], x)
            times: dict[tuple[str, str], list[float]] = {key: [] for key in paths}
            for fn in paths.values():
                fn()  # warm-up
            for _ in range(args.rounds):
                for key, fn in paths.items():
                    median_call(fn, times[key], calls, time.thread_time)
            us = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            for path in ("integer", "float_blocks", "f32_linear"):
                new, old = us[path, "new"], us[path, "baseline"]
                results.append({"layer": name, "format": "Q8_0" if block_format == Q8_0 else "Q4_1",
                                "out": out_features, "in": in_features, "rows": rows, "path": path,
                                "new_us": new, "baseline_us": old, "new_over_baseline": new / old})
            print(f"{name:12s} rows {rows}: us per call new / baseline: " + ", ".join(
                f"{path} {us[path, 'new']:.0f} / {us[path, 'baseline']:.0f}"
                for path in ("integer", "float_blocks", "f32_linear")), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": 1, "rounds": args.rounds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
