"""`vmesh bench offline`: the standard workload through transformers `generate`, the in-process
engine and the mesh, in turn, with the mesh's peak memory and single-request latency."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from vmesh.services.bench.common import for_model, load_workload, machine, mesh_generate, mesh_stats, timed_request
from vmesh.services.bench.lora import lora_flags, write_random_adapters
from vmesh.services.bench.memory import PeakPss
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.bench.peers import PEER_BASELINES, PeerError, PeerProcess, default_peers_dir
from vmesh.services.client import VmeshClient
from vmesh.services.common.model_loading import gguf_model_file, resolve_model_dir
from vmesh.services.common.types import OutputMode, SamplingParams
from vmesh.services.speculative.config import SpeculativeConfig


def transformers_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> Callable[[], float]:
    """Loads the model once; each call of the result is one timed batched `generate` (tokens/s). It
    runs where the engine and the mesh's worker run by default (--device auto): a GPU where there is one."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from vmesh.services.worker.model_runner import resolve_device

    device = resolve_device("auto")
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model = model.to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    def run() -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            elapsed = time.perf_counter() - started
        assert out.shape[1] - width == max_tokens
        return len(prompts) * max_tokens / elapsed

    return run


ENGINE_LOAD_TIMEOUT_S = 900.0  # a model converted and quantized on a loaded 2-core machine
ENGINE_ROUND_TIMEOUT_S = 3600.0


@dataclass
class EngineArm:
    """A warmed-up engine: `run(count)` times one run of the first `count` prompts (all for
    None) and returns its output tokens/s; `latency(prompt)` times that prompt alone."""
    run: Callable[[int | None], float]
    latency: Callable[[list[int]], dict[str, float]]


def _serve_engine_runs(connection: Connection, threads: int, model_dir: Path, prompts: list[list[int]],
                       max_tokens: int, kv_cache_memory: int, dtype: str, weights: str,
                       speculative: SpeculativeConfig | None, max_num_seqs: int, kv_cache_dtype: str) -> None:
    """engine_in_own_process's child: answers each ("run", count) with a timed run's tokens/s and
    each ("latency", prompt) with that prompt's latency figures."""
    torch.set_num_threads(threads)
    with engine_generate(model_dir, prompts, max_tokens, kv_cache_memory=kv_cache_memory, dtype=dtype,
                         weights=weights, speculative=speculative, max_num_seqs=max_num_seqs,
                         kv_cache_dtype=kv_cache_dtype) as arm:
        connection.send("ready")
        while (command := connection.recv())[0] in ("run", "latency"):
            connection.send(arm.run(command[1]) if command[0] == "run" else arm.latency(command[1]))


@contextlib.contextmanager
def engine_in_own_process(model_dir: Path, prompts: list[list[int]], max_tokens: int, kv_cache_memory: int,
                          dtype: str, weights: str, speculative: SpeculativeConfig | None = None,
                          max_num_seqs: int = 256, kv_cache_dtype: str = "auto") -> Iterator[EngineArm]:
    """engine_generate in a process of its own, as a user runs an engine. OpenMP keeps a pool of
    helper threads per thread that starts parallel work, and a second pool in the process (a
    second engine, or transformers' baseline on the main thread) made every engine step slower:
    the standard workload in int8 + bfloat16 ran at 1,100-1,380 tok/s alone and 700-860 beside a
    second engine or a single torch op on the main thread (2026-12-04)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_serve_engine_runs, name=f"vmesh-bench-engine-{dtype}-{weights}", daemon=True,
                            args=(theirs, torch.get_num_threads(), model_dir, prompts, max_tokens, kv_cache_memory,
                                  dtype, weights, speculative, max_num_seqs, kv_cache_dtype))
    child.start()
    theirs.close()

    def receive(timeout_s: float) -> Any:
        if ours.poll(timeout_s):
            with contextlib.suppress(EOFError):
                return ours.recv()
        child.join(timeout=5)
        raise RuntimeError(f"the {dtype} / {weights} engine's process stopped or did not answer within "
                           f"{timeout_s:.0f} s (exit code {child.exitcode}; its output is above)")

    def run(count: int | None = None) -> float:
        ours.send(("run", count))
        return float(receive(ENGINE_ROUND_TIMEOUT_S))

    def latency(prompt: list[int]) -> dict[str, float]:
        ours.send(("latency", prompt))
        return dict(receive(ENGINE_ROUND_TIMEOUT_S))

    try:
        receive(ENGINE_LOAD_TIMEOUT_S)  # "ready"
        yield EngineArm(run, latency)
    finally:
        with contextlib.suppress(OSError, EOFError):
            ours.send(("stop", None))
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
        ours.close()


@contextlib.contextmanager
def engine_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, depth: int = 2,
                    kv_cache_memory: int = 1 << 30, dtype: str = "float32", weights: str = "dequantized",
                    speculative: SpeculativeConfig | None = None,
                    max_num_seqs: int = 256, kv_cache_dtype: str = "auto") -> Iterator[EngineArm]:
    """An in-process engine, warmed up, as an EngineArm: a timed run of the first `count`
    prompts (or all), and one prompt's latency timed as the peers' runner times theirs."""
    from vmesh.services.engine.llm import EngineConfig, LLMEngine
    from vmesh.services.worker.model_runner import WorkerConfig

    engine = LLMEngine.from_config(EngineConfig(worker=WorkerConfig(model=str(model_dir), max_num_seqs=max_num_seqs,
                                                                    kv_cache_memory=kv_cache_memory, dtype=dtype,
                                                                    weights=weights, speculative_config=speculative,
                                                                    kv_cache_dtype=kv_cache_dtype),
                                                pipeline_depth=depth))

    def timed(chosen: list[list[int]], tokens: int) -> float:
        """Seconds to generate exactly `tokens` greedy tokens for each of `chosen`."""
        started = time.perf_counter()
        outs = engine.generate(chosen, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - started
        assert all(len(o.token_ids) == tokens for o in outs)
        return elapsed

    def run(count: int | None = None) -> float:
        chosen = prompts[:count]
        engine.reset_prefix_cache()  # every round starts cold, as the first one does
        return len(chosen) * max_tokens / timed(chosen, max_tokens)

    def latency(prompt: list[int]) -> dict[str, float]:
        """As services/bench/peer_runner.py's latency command, step for step: the prompt's time to
        one token uncached and cached, and the extra time per token of a full-length call."""
        engine.reset_prefix_cache()
        timed(prompts[:1], 2)
        first, repeated, full = timed([prompt], 1), timed([prompt], 1), timed([prompt], max_tokens)
        return {"ttft_ms": first * 1e3, "cached_ttft_ms": repeated * 1e3,
                "mean_itl_ms": (full - repeated) / max(max_tokens - 1, 1) * 1e3}

    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        yield EngineArm(run, latency)
    finally:
        engine.shutdown()


def start_peer(name: str, args: argparse.Namespace, work: dict[str, Any], model_dir: Path) -> PeerProcess:
    """A peer engine loaded on the same weights: vLLM on vmesh's checkpoint of the model,
    llama.cpp on its GGUF file."""
    gguf = gguf_model_file(args.model)
    if gguf is None and name == "llama.cpp":
        raise SystemExit("the llama.cpp baseline needs a GGUF model (--model FILE.gguf, gemma3-270m or the "
                         "embedded one)")
    longest = max(len(p) for p in [*work["prompts"], work["latency_prompt"]])
    try:
        return PeerProcess(name, Path(args.peers_dir) if args.peers_dir else default_peers_dir(), model_dir=model_dir,
                           gguf=gguf or Path(), workload=work["path"], requests=len(work["prompts"]),
                           max_tokens=work["max_tokens"], max_model_len=longest + work["max_tokens"] + 16,
                           threads=torch.get_num_threads(), kv_cache_bytes=args.kv_cache_memory_bytes)
    except PeerError as exc:
        raise SystemExit(str(exc)) from exc


async def mesh_latency(mesh: RunningMesh, prompt: list[int], max_tokens: int,
                       warm_up_prompt: list[int]) -> dict[str, float]:
    """One request alone, twice: the first finds nothing of its prompt in the prefix cache
    (beyond what it shares with the workload's prompts), the second finds all of it."""
    async with VmeshClient(mesh.address) as client:
        await client.complete(token_ids=warm_up_prompt, max_tokens=2, temperature=0)
        before, _worker = await mesh_stats(mesh)
        first = await timed_request(client, prompt, max_tokens)
        after, _worker = await mesh_stats(mesh)
        repeated = await timed_request(client, prompt, max_tokens)
    return {"ttft_ms": first["ttft"] * 1e3, "cached_ttft_ms": repeated["ttft"] * 1e3,
            "mean_itl_ms": statistics.fmean(first["itl"]) * 1e3 if first["itl"] else 0.0,
            # Time per output token after the first: the fair figure where responses merge tokens (speculation).
            "tpot_ms": first["tpot"] * 1e3,
            "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "num_accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens}


# The mesh in its precision modes: `mesh` (float32) always runs; the others on request.
NGRAM_4 = '{"method": "ngram", "num_speculative_tokens": 4}'
MESH_VARIANTS = {"mesh": (), "mesh-native": ("--weights", "native"), "mesh-bf16": ("--dtype", "bfloat16"),
                 # bfloat16 with prefill uncapped beside decodes: throughput over the decode-first ITL bound.
                 "mesh-bf16-nocap": ("--dtype", "bfloat16", "--max-prefill-tokens-with-decodes", "0"),
                 "mesh-int8": ("--weights", "int8"), "mesh-int8-bf16": ("--weights", "int8", "--dtype", "bfloat16"),
                 "mesh-int8-bf16-nocap": ("--weights", "int8", "--dtype", "bfloat16",
                                          "--max-prefill-tokens-with-decodes", "0"),
                 "mesh-int8-bf16-kv8": ("--weights", "int8", "--dtype", "bfloat16", "--kv-cache-dtype", "int8"),
                 "mesh-plaintext": ("--no-internal-tls",),
                 "mesh-spec": ("--speculative-config", NGRAM_4),
                 # The GGUF's own blocks with speculation: single-stream latency against llama.cpp on that file.
                 "mesh-native-spec": ("--weights", "native", "--speculative-config", NGRAM_4),
                 # The batch's fastest mode with speculation.
                 "mesh-int8-bf16-kv8-spec": ("--weights", "int8", "--dtype", "bfloat16", "--kv-cache-dtype", "int8",
                                             "--speculative-config", NGRAM_4),
                 # Every service but the workers 10 nicer, against the default (all equal).
                 "mesh-niced": ("--service-niceness", "10"),
                 "mesh-lora": ()}  # its flags name the adapters bench/lora.py writes
# The plain mesh again, each request asking its whole output at once (final_only) rather than a
# stream of deltas: what an offline batch client does, and what the engine's generate returns.
FINAL_OUTPUTS = "mesh-final"
# The in-process engine in its modes (dtype, weights): with whole outputs and no client beside it,
# what vLLM's offline arm (LLM.generate) is.
# name: (dtype, weights, KV cache dtype)
ENGINE_VARIANTS = {"engine": ("float32", "dequantized", "auto"), "engine-bf16": ("bfloat16", "dequantized", "auto"),
                   "engine-int8-bf16": ("bfloat16", "int8", "auto"),
                   # The same over the 8-bit KV cache.
                   "engine-int8-bf16-kv8": ("bfloat16", "int8", "int8"),
                   # The GGUF's own blocks: single-stream latency timed as the peers time theirs.
                   "engine-native": ("float32", "native", "auto")}


def native_model(args: argparse.Namespace, baseline: str) -> Path:
    """The GGUF file itself, for a `--weights native` baseline: its blocks are what it reads."""
    gguf = gguf_model_file(args.model)
    if gguf is None:
        raise SystemExit(f"the {baseline} baseline needs a GGUF model (--model FILE.gguf, gemma3-270m or the "
                         "embedded one)")
    return gguf


def start_meshes(args: argparse.Namespace, baselines: set[str], model_dir: Path, work: dict[str, Any],
                 stack: contextlib.ExitStack, runs: dict[str, Callable[[], float]],
                 ) -> tuple[dict[str, RunningMesh], dict[str, list[dict[str, float]]]]:
    """A mesh per variant asked for (`mesh` always), stopped when `stack` closes; each one's timed
    run joins `runs`, and every run's figures are kept in the second dict."""
    meshes: dict[str, RunningMesh] = {}
    mesh_runs: dict[str, list[dict[str, float]]] = {}
    for variant, flags in MESH_VARIANTS.items():
        if variant != "mesh" and variant not in baselines:
            continue
        model = str(model_dir)
        if "--weights" in flags and "native" in flags:
            model = str(native_model(args, variant))
        adapters: dict[str, str] = {}
        if variant == "mesh-lora":
            adapters = write_random_adapters(model_dir, Path(stack.enter_context(tempfile.TemporaryDirectory())))
            flags = lora_flags(adapters)
        mesh = meshes[variant] = start_mesh("--model", model, "--kv-cache-memory", args.kv_cache_memory, *flags)
        stack.callback(mesh.stop)
        # The LoRA mesh runs the workload over its four adapters in turn, then under one of them;
        # with mesh-final the plain mesh runs it twice too: streamed, then asking whole outputs.
        arms: dict[str, tuple[list[str], OutputMode]] = {variant: ([], OutputMode.DELTA)}
        if adapters:
            arms = {"mesh-lora": (list(adapters), OutputMode.DELTA),
                    "mesh-lora-1": (list(adapters)[:1], OutputMode.DELTA)}
        elif variant == "mesh" and FINAL_OUTPUTS in baselines:
            arms[FINAL_OUTPUTS] = ([], OutputMode.FINAL_ONLY)
        for name, (models, mode) in arms.items():
            mesh_runs[name] = []

            def run_mesh(mesh: RunningMesh = mesh, name: str = name, models: list[str] = models,
                         mode: OutputMode = mode) -> float:
                mesh_runs[name].append(asyncio.run(mesh_generate(mesh, work["prompts"], work["max_tokens"], models,
                                                                 output_mode=mode)))
                return mesh_runs[name][-1]["tokens_per_s"]

            runs[name] = run_mesh
    return meshes, mesh_runs


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """Each baseline loads once; then `--repeats` rounds run transformers, engine and mesh in
    turn, so that the machine's drift (runs here vary by ~10 %) reaches all three alike. The
    figures reported are each run's median over the rounds."""
    model_dir = resolve_model_dir(args.model)
    scratch = tempfile.TemporaryDirectory()
    work = for_model(load_workload(args.workload, args.requests, args.max_tokens), model_dir, resolve_model_dir(),
                     Path(scratch.name))
    baselines = set(args.baselines.split(","))
    unknown = (baselines - {"transformers", FINAL_OUTPUTS} - set(ENGINE_VARIANTS) - set(MESH_VARIANTS)
               - set(PEER_BASELINES))
    if unknown:
        raise SystemExit(f"unknown baselines {sorted(unknown)}: choose from transformers, "
                         f"{', '.join([*ENGINE_VARIANTS, *MESH_VARIANTS, FINAL_OUTPUTS, *PEER_BASELINES])}")
    prompt_tokens = sum(len(p) for p in work["prompts"])
    result: dict[str, Any] = {"mode": "offline", "workload": work["name"], "requests": len(work["prompts"]),
                              "prompt_tokens": prompt_tokens, "max_tokens": work["max_tokens"],
                              "repeats": args.repeats, **machine(), "tokens_per_s": {}, "runs_tokens_per_s": {}}
    runs: dict[str, Callable[[], float]] = {}
    engines: dict[str, EngineArm] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(scratch)  # the tokenized workload file, for as long as the peers read it
        if "transformers" in baselines:
            runs["transformers"] = transformers_generate(model_dir, work["prompts"], work["max_tokens"])
        for name, (dtype, weights, kv_cache_dtype) in ENGINE_VARIANTS.items():
            if name in baselines:
                # The engine runs on its offline defaults, the mesh on its serving ones: said in
                # the results, for the engine / mesh ratio is not the serving path's cost alone.
                from vmesh.services.engine.llm import EngineConfig

                result["engine_max_prefill_tokens_with_decodes"] = EngineConfig().max_prefill_tokens_with_decodes
                engines[name] = stack.enter_context(engine_in_own_process(
                    native_model(args, name) if weights == "native" else model_dir, work["prompts"],
                    work["max_tokens"], args.kv_cache_memory_bytes, dtype, weights, kv_cache_dtype=kv_cache_dtype))
                runs[name] = functools.partial(engines[name].run, None)  # every prompt
        peers = {name: stack.enter_context(contextlib.closing(start_peer(name, args, work, model_dir)))
                 for name in PEER_BASELINES if name in baselines}
        runs.update({name: peer.run for name, peer in peers.items()})
        meshes, mesh_runs = start_meshes(args, baselines, model_dir, work, stack, runs)
        for name in runs:
            result["runs_tokens_per_s"][name] = []
        # Services by "<service>" for the float32 mesh, "<variant>/<service>" for the others.
        watched = {(service if variant == "mesh" else f"{variant}/{service}"): pid
                   for variant, mesh in meshes.items() for service, (_address, pid) in mesh.services.items()}
        with PeakPss(watched | {name: peer.pid for name, peer in peers.items()}) as peaks:
            for _ in range(args.repeats):
                for name, run in runs.items():
                    result["runs_tokens_per_s"][name].append(run())
        result["mesh_peak_pss_mib"] = {name: mib for name, mib in peaks.mib.items() if name in watched}
        result["peer_peak_pss_mib"] = {name: mib for name, mib in peaks.mib.items() if name in peers}
        result["peer_latency"] = {name: peer.latency() for name, peer in peers.items()}
        result["engine_latency"] = {name: arm.latency(work["latency_prompt"]) for name, arm in engines.items()}
        result["mesh_duty_cycle"] = statistics.median(r["duty_cycle"] for r in mesh_runs["mesh"])
        result["mesh_ms_per_step"] = {variant: statistics.median(r["ms_per_step"] for r in runs_of_variant)
                                      for variant, runs_of_variant in mesh_runs.items()}
        # Speculative meshes: drafts verified and accepted over every round (the spec_decode counters).
        result["mesh_drafts"] = {variant: {key: sum(r[key] for r in runs_of_variant)
                                           for key in ("num_draft_tokens", "num_accepted_tokens")}
                                 for variant, runs_of_variant in mesh_runs.items()
                                 if any(r["num_draft_tokens"] for r in runs_of_variant)}
        latencies = {variant: asyncio.run(mesh_latency(mesh, work["latency_prompt"], work["max_tokens"],
                                                       work["prompts"][0])) for variant, mesh in meshes.items()}
        result["latency"] = latencies.pop("mesh")
        result["variant_latency"] = latencies
    result["tokens_per_s"] = {name: statistics.median(v) for name, v in result["runs_tokens_per_s"].items()}
    # Every run computes the same prompts and outputs, so its prompt rate follows from its output rate.
    per_output_token = prompt_tokens / (len(work["prompts"]) * work["max_tokens"])
    result["prompt_tokens_per_s"] = {name: tps * per_output_token for name, tps in result["tokens_per_s"].items()}
    mesh_tps = result["tokens_per_s"]["mesh"]
    result["ratio_to_mesh"] = {k: v / mesh_tps for k, v in result["tokens_per_s"].items()}
    if "mesh-lora" in result["tokens_per_s"]:  # LoRA against the base model, in the same rounds
        result["lora_to_base"] = {"four_adapters_mixed": result["ratio_to_mesh"]["mesh-lora"],
                                  "one_adapter": result["ratio_to_mesh"]["mesh-lora-1"]}
    print_report(result, work, args.repeats)
    return result


def acceptance(counts: dict[str, Any]) -> str:
    drafts, accepted = counts["num_draft_tokens"], counts["num_accepted_tokens"]
    return f"{accepted} of {drafts} draft tokens accepted ({100 * accepted / max(drafts, 1):.1f} %)"


def print_report(result: dict[str, Any], work: dict[str, Any], repeats: int) -> None:
    """`offline`'s result as a table of rates, then latency and memory lines."""
    mesh_tps = result["tokens_per_s"]["mesh"]
    label = "out tok/s" if repeats == 1 else "median"
    print(f"workload {work['name']}: {len(work['prompts'])} prompts, {result['prompt_tokens']} prompt tokens, "
          f"{work['max_tokens']} output tokens each")
    print(f"{'run':>14} {label:>9} {'prompt tok/s':>12} {'x mesh':>7}" + ("   every round" if repeats > 1 else ""))
    for name, tps in result["tokens_per_s"].items():
        rounds = "  ".join(f"{v:.1f}" for v in result["runs_tokens_per_s"][name]) if repeats > 1 else ""
        print(f"{name:>14} {tps:>9.1f} {result['prompt_tokens_per_s'][name]:>12.0f} {tps / mesh_tps:>7.2f}   {rounds}")
    if "lora_to_base" in result:
        lora = result["lora_to_base"]
        print(f"LoRA: 4 adapters mixed {lora['four_adapters_mixed']:.2f}x the base model's throughput, one adapter "
              f"{lora['one_adapter']:.2f}x (overhead {100 * (1 - lora['one_adapter']):.0f} %)")
    lat = result["latency"]
    print(f"single request through the mesh: TTFT {lat['ttft_ms']:.0f} ms (its prompt not cached; "
          f"{lat['cached_ttft_ms']:.0f} ms repeated, from the prefix cache), mean ITL {lat['mean_itl_ms']:.1f} ms, "
          f"TPOT {lat['tpot_ms']:.1f} ms")
    print("wall time per step, median: " + ", ".join(f"{variant} {ms:.1f} ms"
                                                     for variant, ms in result["mesh_ms_per_step"].items()))
    for name, lat in result["variant_latency"].items():
        print(f"single request through {name}: TTFT {lat['ttft_ms']:.0f} ms ({lat['cached_ttft_ms']:.0f} ms "
              f"repeated), mean ITL {lat['mean_itl_ms']:.1f} ms, TPOT {lat['tpot_ms']:.1f} ms"
              + (f", {acceptance(lat)}" if lat["num_draft_tokens"] else ""))
    for name, drafts in result["mesh_drafts"].items():
        print(f"{name}, every round of the workload: {acceptance(drafts)}")
    for name, lat in [*result["engine_latency"].items(), *result["peer_latency"].items()]:
        print(f"single request, {name}: TTFT {lat['ttft_ms']:.0f} ms ({lat['cached_ttft_ms']:.0f} ms repeated), "
              f"mean ITL {lat['mean_itl_ms']:.1f} ms (one-token and full-length calls, no streaming)")
    for variant in ("mesh", *result["variant_latency"]):
        prefix = "" if variant == "mesh" else f"{variant}/"
        memory = {name.removeprefix(prefix): mib for name, mib in result["mesh_peak_pss_mib"].items()
                  if (name.startswith(prefix) if prefix else "/" not in name)}
        print(f"{variant} peak PSS: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items())
              + f"; all {sum(memory.values()):.0f} MiB")
    for name, mib in result["peer_peak_pss_mib"].items():
        print(f"{name} peak PSS (its processes together): {mib:.0f} MiB")
