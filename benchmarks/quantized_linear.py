"""`--weights native`: the quantized linear kernel against the float32 Linear path on the
embedded model's own layer shapes, all of the model's linears in a row (as a step runs them), and
single-request decode of the in-process engine in both modes.

Kernels: for each layer shape and row count, `--rounds` rounds alternate the two paths (so that
both see the same machine state), each timing `--calls` calls; the median per call is reported.
The float32 side is what `--weights dequantized` runs: oneDNN's packed weight, 1-4 rows through
the small-batch C kernel over it. Engine: one request at a time (a short chat prompt,
`--tokens` tokens, greedy, EOS ignored), inter-token latency from step to step.

    .venv/bin/python -m benchmarks.quantized_linear [--rows 1 4 16 64] [--rounds 5] [--calls 20] [--tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from vmesh.services.common.model_loading import cache_dir_path, load_tokenizer, resolve_model_dir
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.linear import Linear
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.quantized_linear import QuantizedLinear


def time_call(fn: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def bench_layers(native: ModelRunner, rows_list: list[int], rounds: int, calls: int) -> list[dict]:
    from vmesh.kernels.cpu_native import load_cpu_kernels

    kernels = load_cpu_kernels(cache_dir_path(None))
    layer = native.model.layers[0]
    shapes = {"qkv_proj": layer.qkv_proj, "o_proj": layer.o_proj, "gate_up_proj": layer.gate_up_proj,
              "down_proj": layer.down_proj, "lm_head": native.model.lm_head}
    results = []
    for name, quantized in shapes.items():
        assert isinstance(quantized, QuantizedLinear)
        # One float32 layer at a time: the dequantized path's layout, built from the same values.
        plain = Linear(quantized.dequantized(), quantized.bias, small_batch_kernels=kernels)
        for rows in rows_list:
            x = torch.randn(rows, quantized.in_features)
            torch.testing.assert_close(quantized(x), plain(x), rtol=1e-4, atol=1e-3)
            q_times, f_times = [], []
            for _ in range(rounds):
                q_times.append(time_call(lambda q=quantized, x=x: q(x), calls))
                f_times.append(time_call(lambda f=plain, x=x: f(x), calls))
            q, f = statistics.median(q_times), statistics.median(f_times)
            results.append({"layer": name, "format": quantized.format, "out": quantized.out_features,
                            "in": quantized.in_features, "rows": rows, "quantized_us": q * 1e6, "float32_us": f * 1e6,
                            "speedup": f / q})
            print(f"{name:12s} {quantized.format} [{quantized.out_features:5d} x {quantized.in_features:4d}] "
                  f"rows {rows:3d}: quantized {q * 1e6:8.1f} us, float32 {f * 1e6:8.1f} us, x{f / q:.2f}", flush=True)
        del plain
    return results


def run_all(linears: list, inputs: dict[int, torch.Tensor]) -> None:
    for layer in linears:
        layer(inputs[layer.in_features])


def bench_all_linears(runners: dict[str, ModelRunner], rows_list: list[int], rounds: int, calls: int) -> list[dict]:
    """Every linear of the model once, in order, as a step runs them: the single-shape figures
    above call one layer over and over, whose float32 weight (1-7 MiB) then stays in cache,
    while a real step streams all 513 MiB of them."""
    results = []
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width) for width in (576, 1536)}
        times: dict[str, list[float]] = {mode: [] for mode in runners}
        for _ in range(rounds):
            for mode, runner in runners.items():
                step = functools.partial(run_all, runner.model.linears(), inputs)
                times[mode].append(time_call(step, max(1, calls // 4)))
        q, f = statistics.median(times["native"]), statistics.median(times["dequantized"])
        results.append({"rows": rows, "native_ms": q * 1e3, "dequantized_ms": f * 1e3, "speedup": f / q})
        print(f"all {len(runners['native'].model.linears())} linears, rows {rows:3d}: native {q * 1e3:7.2f} ms, "
              f"dequantized {f * 1e3:7.2f} ms, x{f / q:.2f}", flush=True)
    return results


def bench_decode(runner: ModelRunner, tokenizer, prompt: list[int], tokens: int, repeats: int) -> dict:
    """Single request: median over `repeats` requests of the mean inter-token latency."""
    from vmesh.services.worker.persistent_batch import PersistentBatch

    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks)
    runner.last_step = -1
    engine = LLMEngine(runner, tokenizer, EngineConfig())
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    itls = []
    try:
        for _ in range(repeats + 1):  # the first request warms up
            engine.reset_prefix_cache()
            engine.add_request(prompt, params)
            stamps = []
            while engine.has_unfinished():
                for out in engine.step():
                    stamps.extend([time.perf_counter()] * len(out.new_token_ids))
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            itls.append(statistics.fmean(gaps))
    finally:
        engine.shutdown()
    itl = statistics.median(itls[1:])
    return {"mean_itl_ms": itl * 1e3, "tokens_per_s": 1 / itl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    runners = {mode: ModelRunner.load(WorkerConfig(weights=mode, kv_cache_memory=64 << 20, max_num_seqs=4))
               for mode in ("native", "dequantized")}
    held = {mode: runner.model.held_bytes() for mode, runner in runners.items()}
    for mode, bytes_held in held.items():
        print(f"{mode}: weights {sum(bytes_held.values()) / (1 << 20):.1f} MiB "
              f"({', '.join(f'{k} {v / (1 << 20):.1f}' for k, v in bytes_held.items() if v)})")
    layers = bench_layers(runners["native"], args.rows, args.rounds, args.calls)
    whole = bench_all_linears(runners, args.rows, args.rounds, args.calls)

    tokenizer = load_tokenizer(resolve_model_dir(None))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    decode = {}
    for _ in range(2):  # interleaved: native, dequantized, native, dequantized
        for mode, runner in runners.items():
            result = bench_decode(runner, tokenizer, prompt, args.tokens, args.repeats)
            decode.setdefault(mode, []).append(result["mean_itl_ms"])
    summary = {mode: {"mean_itl_ms": statistics.median(v), "tokens_per_s": 1e3 / statistics.median(v)}
               for mode, v in decode.items()}
    for mode, result in summary.items():
        print(f"engine, one request, {args.tokens} tokens, {mode}: ITL {result['mean_itl_ms']:.2f} ms, "
              f"{result['tokens_per_s']:.0f} tokens/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": args.threads,
                       "held_bytes": held, "layers": layers, "all_linears": whole,
                       "decode": summary}, f, indent=2)


if __name__ == "__main__":
    main()
