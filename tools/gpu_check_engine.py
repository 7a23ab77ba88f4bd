"""tools/gpu_check.py's model sections: the worker and the in-process engine on one device with the
tiny test models and the embedded model, greedy tokens against transformers on the same device, and
`vmesh serve --device DEVICE` end to end (gRPC, HTTP, a kill -9 of the worker and its recovery)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.conftest import CHAT_PROMPTS
from tests.support.eventually import eventually, eventually_blocking
from tests.support.plan_driver import DrivenRequest, drive
from tests.support.reference import assert_greedy_match, hf_greedy
from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama, save_tiny_qwen2
from tests.unit.test_model_parity_tiny import PROMPT_LENGTHS
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


def greedy_row(label: str, ours: list[int], reference_model: Any, prompt: list[int]) -> dict[str, Any]:
    """Our greedy tokens against transformers' (tests/support/reference.py's rule: equal, or
    diverging only at a near-tie of the reference)."""
    want = hf_greedy(reference_model, prompt, len(ours))
    same = next((i for i, (a, b) in enumerate(zip(ours, want.token_ids)) if a != b), len(ours))
    try:
        assert_greedy_match(ours, want, label=label)
        ok, note = True, ""
    except AssertionError as exc:
        ok, note = False, str(exc).splitlines()[0]
    return {"request": label, "tokens": len(ours), "equal_prefix": same, "ok": ok, **({"note": note} if note else {})}


def _release() -> None:
    """Return what the caller dropped to the device (the next section's runner wants the memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_tiny(device: str, dry_run: bool, work: Path) -> dict[str, Any]:
    """The worker on the tiny Llama and Qwen2 checkpoints: a ragged batch, late joiners, chunked
    prefill (tests/unit/test_model_parity_tiny.py's schedule). float32 must match transformers;
    bfloat16 against transformers in bfloat16 is reported (roundings differ)."""
    rows: list[dict[str, Any]] = []
    backends = set()
    for kind in ("llama",) if dry_run else ("llama", "qwen2"):
        path = work / f"tiny-{kind}"
        reference = (save_tiny_qwen2 if kind == "qwen2" else save_tiny_llama)(path)
        generator = torch.Generator().manual_seed(7)
        lengths = PROMPT_LENGTHS[:3] if dry_run else PROMPT_LENGTHS
        prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]
        for dtype in ("float32", "bfloat16"):
            runner = ModelRunner.load(WorkerConfig(model=str(path), device=device, dtype=dtype, block_size=16,
                                                   kv_cache_memory=16 << 20, max_num_seqs=8))
            backends.add(runner.backend.name)
            requests = [DrivenRequest(p, 6 if dry_run else 24, join_step=2 * i) for i, p in enumerate(prompts)]
            drive(runner, requests, chunk=7)
            model = reference.to(device=device, dtype=getattr(torch, dtype))
            for i, r in enumerate(requests):
                row = greedy_row(f"{kind} {dtype} request {i}", r.output, model, r.prompt)
                rows.append({**row, "dtype": dtype, "required": dtype == "float32"})
            del runner
            _release()
    return {"passed": all(r["ok"] for r in rows if r["required"]), "attention_backends": sorted(backends),
            "float32_equal": sum(r["ok"] for r in rows if r["required"]),
            "bfloat16_equal": sum(r["ok"] for r in rows if not r["required"]),
            "requests_per_dtype": len(rows) // 2, "rows": rows}


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from vmesh.services.common.model_loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in CHAT_PROMPTS[:count]]


def reference_model(model_dir: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    return model.to(device).eval()


def engine_embedded(device: str, dry_run: bool, model_dir: Path) -> dict[str, Any]:
    """The in-process engine (scheduler, worker at pipeline depth 2, detokenizer) on the embedded
    model: the chat prompts in one batch, greedy, against transformers float32 on the same device;
    then one seeded sampled request twice beside an unseeded one (the same seed, the same tokens)."""
    from vmesh.services.engine.llm import EngineConfig, LLMEngine

    prompts = chat_prompts(model_dir, 2 if dry_run else len(CHAT_PROMPTS))
    max_tokens = 4 if dry_run else 32
    started = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(worker=WorkerConfig(
        model=str(model_dir), device=device, kv_cache_memory=256 << 20, max_num_seqs=32), pipeline_depth=2))
    try:
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        generate_s = time.perf_counter() - started
        backend = engine.runner.backend.name
        # Seeded sampling draws on a generator of the logits' device: the same seed twice in one
        # batch, beside an unseeded row, gives the same tokens.
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=max_tokens, ignore_eos=True)
        sampled = engine.generate([prompts[0]] * 3, [seeded, seeded, SamplingParams(
            temperature=0.8, max_tokens=max_tokens, ignore_eos=True)])
        seeded_equal = list(sampled[0].token_ids) == list(sampled[1].token_ids)
    finally:
        engine.shutdown()
    reference = reference_model(model_dir, device)
    rows = [greedy_row(f"chat prompt {i}", list(o.token_ids), reference, p)
            for i, (o, p) in enumerate(zip(outputs, prompts))]
    del engine, reference
    _release()
    return {"passed": all(r["ok"] for r in rows) and seeded_equal, "seeded_sampling_repeats": seeded_equal,
            "attention_backend": backend, "equal": sum(r["ok"] for r in rows),
            "requests": len(rows), "max_tokens": max_tokens, "load_s": load_s, "generate_s": generate_s, "rows": rows}


async def _grpc_outputs(address: str, prompts: list[list[int]], max_tokens: int,
                        kill: Callable[[list[int]], object] | None = None) -> list[list[int]]:
    """Greedy streams of every prompt at once; `kill` runs once each has streamed a token, given
    how many each has."""
    progress = [0] * len(prompts)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async with VmeshClient(address) as client:
            async for out in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                             ignore_eos=True, timeout=300):
                tokens += out.token_ids
                progress[i] = len(tokens)
        return tokens

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    if kill is not None:
        await eventually(lambda: all(progress) or any(t.done() for t in tasks), budget_s=120, interval_s=0.005)
        kill(list(progress))
    return list(await asyncio.gather(*tasks))


def _http_completion(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{base_url}/models").json()["data"][0]["id"]
        reply = client.post(f"{base_url}/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0, "ignore_eos": True})
    return {"status": reply.status_code, "text": reply.json()["choices"][0]["text"] if reply.is_success else reply.text}


def serve(device: str, dry_run: bool, model_dir: Path) -> dict[str, Any]:
    """`vmesh serve --device DEVICE`: greedy gRPC streams against transformers, the same completion
    over HTTP, then the worker killed (-9) twice: under load, where every stream must still end
    with the same tokens (the scheduler replays them to the restarted worker), and between requests,
    where the next ones must be served, the same again."""
    from vmesh.services.common.model_loading import load_tokenizer

    prompts = chat_prompts(model_dir, 2 if dry_run else 6)
    max_tokens = 24 if dry_run else 128  # enough steps that the kill under load lands mid-stream
    started = time.perf_counter()
    mesh = start_mesh("--model", str(model_dir), "--device", device, "--kv-cache-memory", "512MiB",
                      "--worker-recovery-timeout", "180", "--failover-timeout", "180")
    result: dict[str, Any] = {"start_s": time.perf_counter() - started}

    def kill_worker(streamed: list[int]) -> None:
        result["tokens_streamed_at_kill"] = streamed  # each below max_tokens: the kill landed mid-stream
        mesh.kill_service("worker")

    def wait_restarted(count: int) -> None:
        def restarted() -> bool:
            mesh.refresh()
            return mesh.restarts.get("worker", 0) == count

        eventually_blocking(restarted, f"the worker was not restarted {count} times", budget_s=180, interval_s=0.2)

    try:
        grpc_tokens = asyncio.run(_grpc_outputs(mesh.address, prompts, max_tokens))
        reference = reference_model(model_dir, device)
        rows = [greedy_row(f"gRPC prompt {i}", t, reference, p) for i, (t, p) in enumerate(zip(grpc_tokens, prompts))]
        del reference
        _release()
        http = _http_completion(mesh.http_url, prompts[0], max_tokens)
        http_ok = http["status"] == 200 and http["text"] == load_tokenizer(model_dir).decode(grpc_tokens[0])
        kills = 0
        if not dry_run:  # on a CPU tests/e2e/test_chaos.py kills under load, at far more cost than here
            killed_at = time.perf_counter()
            under_load = asyncio.run(_grpc_outputs(mesh.address, prompts, max_tokens, kill=kill_worker))
            result["kill_under_load_to_all_streams_done_s"] = time.perf_counter() - killed_at
            result["equal_across_kill_under_load"] = under_load == grpc_tokens
            kills += 1
            wait_restarted(kills)
        mesh.kill_service("worker")  # nothing in flight: the scheduler learns of it at its next plan
        killed_at, kills = time.perf_counter(), kills + 1
        between = asyncio.run(_grpc_outputs(mesh.address, prompts, max_tokens))
        result["kill_between_requests_to_served_s"] = time.perf_counter() - killed_at
        wait_restarted(kills)
        result.update({
            "grpc_equal": sum(r["ok"] for r in rows), "requests": len(rows), "max_tokens": max_tokens, "rows": rows,
            "http_status": http["status"], "http_text_equals_grpc": http_ok,
            "equal_after_kill_between_requests": between == grpc_tokens, "worker_restarts": kills})
        result["passed"] = (all(r["ok"] for r in rows) and http_ok and result.get("equal_across_kill_under_load", True)
                            and result["equal_after_kill_between_requests"])
    except BaseException:
        print("".join(mesh.output[-60:]), flush=True)  # the launcher's side of the failure
        raise
    finally:
        result["stop_exit_code"] = mesh.stop()
    return result
