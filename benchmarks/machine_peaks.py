"""This CPU's ceilings for a decode step: the arithmetic peak of each product instruction the
kernels use, and the rate at which memory streams into the cores.

    python -m benchmarks.machine_peaks [--threads 2] [--out FILE]

Each instruction's peak comes from a loop of independent accumulator chains (12 of them, enough
to cover the instruction's latency) so that only its throughput limits the loop: a float32 FMA
(VFMADD231PS zmm: 16 multiply-adds), a bfloat16 pair dot product (VDPBF16PS zmm: 32) and an int8
dot product (VPDPBUSD zmm: 64). The figures are operations per second (a multiply-add counts
two), per thread and for `--threads` threads at once. Memory: a sum over a buffer 16x the last
level cache, per thread and for all threads. These bound every figure in benchmarks/README.md's
"Against the machine's ceilings": a layer can do no better than the instruction it is built on.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vmesh.kernels.cpu_native import CFLAGS

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12

/* Each returns a value built from every accumulator, so that no chain is optimised away. */
double peak_fma_f32(int64_t iterations, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 acc[CHAINS];
        const __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
        for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps((float)c);
        for (int64_t i = 0; i < iterations; ++i)
            for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_fmadd_ps(a, b, acc[c]);
        for (int c = 0; c < CHAINS; ++c) total += _mm512_reduce_add_ps(acc[c]);
    }
    return total;
}

double peak_dot_bf16(int64_t iterations, int threads) {
#if defined(__AVX512BF16__)
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512 acc[CHAINS];
        const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps((float)c);
        for (int64_t i = 0; i < iterations; ++i)
            for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
        for (int c = 0; c < CHAINS; ++c) total += _mm512_reduce_add_ps(acc[c]);
    }
    return total;
#else
    (void)iterations, (void)threads;
    return -1.0;
#endif
}

double peak_dot_int8(int64_t iterations, int threads) {
#if defined(__AVX512VNNI__)
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m512i acc[CHAINS];
        const __m512i a = _mm512_set1_epi8(1);
        for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
        for (int64_t i = 0; i < iterations; ++i)
            for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, a);
        for (int c = 0; c < CHAINS; ++c) total += (double)_mm512_reduce_add_epi32(acc[c]);
    }
    return total;
#else
    (void)iterations, (void)threads;
    return -1.0;
#endif
}

/* Reads `floats` floats once (a multiple of 64); the sum keeps the loads. */
double stream_read(const float *buffer, int64_t floats, int threads) {
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t block = 0; block < floats / 64; ++block) {
        const float *p = buffer + block * 64;
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)),
                                       _mm512_add_ps(_mm512_loadu_ps(p + 32), _mm512_loadu_ps(p + 48)));
        total += _mm512_reduce_add_ps(s);
    }
    return total;
}
"""

# Operations per instruction per iteration of one chain: a multiply-add counts two.
INSTRUCTIONS = {"fma_f32": 2 * 16, "dot_bf16": 2 * 32, "dot_int8": 2 * 64}


def build(directory: Path) -> ctypes.CDLL:
    source, library = directory / "peaks.c", directory / "peaks.so"
    source.write_text(SOURCE)
    flags = [flag for flag in CFLAGS if flag != "-Werror=implicit-function-declaration"]
    subprocess.run(["cc", *flags, "-shared", "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    for name in INSTRUCTIONS:
        function = getattr(lib, f"peak_{name}")
        function.argtypes, function.restype = [ctypes.c_int64, ctypes.c_int], ctypes.c_double
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.stream_read.restype = ctypes.c_double
    return lib


def best_seconds(run, repeats: int = 5) -> float:
    run()  # threads started, clocks up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(lib: ctypes.CDLL, threads: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    iterations = 20_000_000
    for name, ops in INSTRUCTIONS.items():
        function = getattr(lib, f"peak_{name}")
        if function(1, 1) < 0:
            figures[f"{name}_gops"] = 0.0  # this CPU lacks the instruction
            continue
        seconds = best_seconds(lambda f=function: f(iterations, threads))
        figures[f"{name}_gops"] = iterations * 12 * ops * threads / seconds / 1e9
    buffer = torch.ones(256 * 2**20 // 4)  # 256 MiB: many times any last-level cache here
    seconds = best_seconds(lambda: lib.stream_read(buffer.data_ptr(), buffer.numel(), threads))
    figures["read_gb_per_s"] = buffer.numel() * 4 / seconds / 1e9
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        lib = build(Path(directory))
        result = {"one_thread": measure(lib, 1), f"{args.threads}_threads": measure(lib, args.threads),
                  "date": time.strftime("%Y-%m-%d %H:%M")}
    for label, figures in result.items():
        if isinstance(figures, dict):
            print(f"{label}: " + ", ".join(f"{name} {value:.1f}" for name, value in figures.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
