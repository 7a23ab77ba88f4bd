"""The whole mesh as separate processes over real gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.conftest import scheduler_stats, wait_idle
from tests.support.eventually import BUDGET_S
from tests.support.meshes import stops_cleanly
from tests.support.reference import assert_greedy_match
from vmesh.services.bench.mesh import STOP_TIMEOUT_S, start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.cache_events import CacheView
from vmesh.services.common.wire.cache import cache_update_from_proto
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


async def _greedy_all(address: str, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    async with VmeshClient(address) as client:
        results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True) for p in prompts))
    return [ids for _text, ids, _last in results]


def check_parity(mesh, chat_prompt_ids, reference_outputs) -> None:
    outputs = asyncio.run(_greedy_all(mesh.address, chat_prompt_ids))
    for i, ids in enumerate(outputs):
        assert_greedy_match(ids, reference_outputs[i], label=f"mesh prompt {i}")
    stats = wait_idle(mesh)
    assert stats.num_used_blocks == 0


def test_greedy_parity_16_concurrent(default_mesh, chat_prompt_ids, reference_outputs):
    check_parity(default_mesh, chat_prompt_ids, reference_outputs)
    stats = scheduler_stats(default_mesh)
    assert stats.pipeline_depth == 2 and not stats.stateless_worker


@pytest.mark.parametrize("flags", [
    ("--pipeline-depth", "1", "--stateless-worker"),
    ("--pipeline-depth", "2", "--stateless-worker", "--detokenizers", "2"),
    ("--pipeline-depth", "1"),
], ids=["depth1-stateless-1detok", "depth2-stateless-2detok", "depth1-stateful-1detok"])
def test_greedy_parity_in_every_mode(flags, chat_prompt_ids, reference_outputs):
    with stops_cleanly(start_mesh(*flags)) as mesh:
        check_parity(mesh, chat_prompt_ids, reference_outputs)


def test_greedy_parity_across_two_worker_groups(chat_prompt_ids, reference_outputs):
    """Data parallelism: two worker groups (a worker and its scheduler each) behind one frontend,
    half the prompts of the single-group checks (each group still serves several at once)."""
    with stops_cleanly(start_mesh("--data-parallel-size", "2", "--detokenizers", "2")) as mesh:
        outputs = asyncio.run(_greedy_all(mesh.address, chat_prompt_ids[:8]))
        for i, ids in enumerate(outputs):
            assert_greedy_match(ids, reference_outputs[i], label=f"data-parallel prompt {i}")
        for name in ("scheduler-0", "scheduler-1"):
            stats = wait_idle(mesh, name=name)
            assert stats.steps > 0, f"{name} served nothing"
            assert stats.num_used_blocks == 0
        # Routing by the groups' cache streams: a prompt sent again goes to the group whose
        # stream says it holds the prompt's prefix, and hits there.
        prompt = chat_prompt_ids[0]
        views = {name: asyncio.run(_cache_view(mesh, name)) for name in ("scheduler-0", "scheduler-1")}
        holder = max(views, key=lambda name: views[name].cached_tokens(prompt))
        assert views[holder].cached_tokens(prompt) >= len(prompt) // 2
        before = {name: wait_idle(mesh, name=name).prefix_cache_hits for name in views}
        asyncio.run(_greedy_all(mesh.address, [prompt], max_tokens=2))
        after = {name: wait_idle(mesh, name=name).prefix_cache_hits for name in views}
        assert after[holder] > before[holder] and all(after[n] == before[n] for n in views if n != holder)


async def _cache_view(mesh, name: str) -> CacheView:
    """The first message of the scheduler's cache stream (a snapshot), as a frontend sees it."""
    async with mesh.channel(name) as ch:
        stream = scheduler_pb2_grpc.SchedulerServiceStub(ch).WatchCache(scheduler_pb2.WatchCacheRequest())
        first = await anext(aiter(stream))
        stream.cancel()
    return CacheView(cache_update_from_proto(first))


def test_greedy_parity_with_a_tensor_parallel_worker_group(chat_prompt_ids, reference_outputs):
    """Tensor parallelism: three worker processes (the embedded model's 9 query and 3 KV heads,
    3 each and 1 each) hold one model between them behind one scheduler; a rank that dies takes
    its group down."""
    with stops_cleanly(start_mesh("--tensor-parallel-size", "3")) as mesh:
        assert {name for name in mesh.services if name.startswith("worker")} == {
            "worker-rank0", "worker-rank1", "worker-rank2"}
        outputs = asyncio.run(_greedy_all(mesh.address, chat_prompt_ids[:3]))
        for i, ids in enumerate(outputs):
            assert_greedy_match(ids, reference_outputs[i], label=f"tensor-parallel prompt {i}")
        assert wait_idle(mesh).num_used_blocks == 0


def test_64_concurrent_streams_complete_with_usage(default_mesh, embedded_tokenizer):
    prompts = [f"Request number {i}: say something about the number {i}." for i in range(64)]

    async def one(client, i):
        chunks, last = 0, None
        ids: list[int] = []
        async for out in client.generate(chat=[{"role": "user", "content": prompts[i]}], max_tokens=8 + i % 9,
                                         temperature=0.7, seed=i, ignore_eos=True):
            chunks += 1
            ids += out.token_ids
            last = out
        return chunks, ids, last

    async def main():
        async with VmeshClient(default_mesh.address) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for i, (chunks, ids, last) in enumerate(results):
        expected_prompt = len(embedded_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompts[i]}], add_generation_prompt=True, tokenize=True, return_dict=False))
        assert last.finish_reason == 2  # LENGTH
        assert len(ids) == 8 + i % 9 == last.usage.completion_tokens
        assert last.usage.prompt_tokens == expected_prompt
        assert chunks >= 1


def test_seeded_sampling_is_reproducible_through_the_mesh(default_mesh):
    async def main():
        async with VmeshClient(default_mesh.address) as client:
            kwargs = dict(text="Once upon a time", max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
            alone = await client.complete(**kwargs)
            crowd = await asyncio.gather(client.complete(**kwargs),
                                         *(client.complete(text=f"noise {i}", max_tokens=16) for i in range(5)))
            return alone[1], crowd[0][1]

    alone, crowded = asyncio.run(main())
    assert alone == crowded


def test_cancelling_20_streams_frees_everything(default_mesh):
    async def main():
        async with VmeshClient(default_mesh.address) as client:
            async def cancel_after_two(i):
                got = 0
                async for _ in client.generate(text=f"Tell me a long story number {i}", max_tokens=500,
                                               ignore_eos=True):
                    got += 1
                    if got == 2:
                        break  # closing the iterator cancels the call
                return got
            return await asyncio.gather(*(cancel_after_two(i) for i in range(20)))

    assert asyncio.run(main()) == [2] * 20
    stats = wait_idle(default_mesh)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0


def test_reset_prefix_cache_makes_a_repeated_prompt_miss(default_mesh):
    from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    prompt = [1, *range(100, 140)]  # 41 tokens: two full blocks of 16 to cache

    def run_and_count_hits() -> int:
        before = scheduler_stats(default_mesh).prefix_cache_hits
        asyncio.run(_greedy_all(default_mesh.address, [prompt], max_tokens=2))
        return wait_idle(default_mesh).prefix_cache_hits - before

    async def reset() -> int:
        async with default_mesh.channel("scheduler") as ch:
            response = await scheduler_pb2_grpc.SchedulerServiceStub(ch).ResetPrefixCache(
                scheduler_pb2.ResetPrefixCacheRequest(), timeout=10)
        return response.num_dropped_blocks

    run_and_count_hits()
    assert run_and_count_hits() == 2  # the repeat finds both blocks cached
    assert asyncio.run(reset()) >= 2
    assert run_and_count_hits() == 0
    assert wait_idle(default_mesh).num_used_blocks == 0


def test_deadline_propagates_and_aborts(default_mesh):
    async def main():
        async with VmeshClient(default_mesh.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in client.generate(text="Write an essay", max_tokens=1000, ignore_eos=True, timeout=1.0):
                    pass
            return err.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_idle(default_mesh)
    assert stats.num_running == 0 and stats.num_used_blocks == 0


INVALID = [
    (dict(text=""), "prompt"),
    (dict(text="hi " * 9000), "prompt"),
    (dict(text="hi", max_tokens=0), "max_tokens"),
    (dict(text="hi", max_tokens=10_000), "max_tokens"),
    (dict(text="hi", temperature=-0.5), "temperature"),
    (dict(text="hi", temperature=float("nan")), "temperature"),
    (dict(text="hi", repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(text="hi", top_p=0.0), "top_p"),
    (dict(text="hi", top_p=1.5), "top_p"),
    (dict(text="hi", top_k=-2), "top_k"),
    (dict(text="hi", min_p=1.5), "min_p"),
    (dict(text="hi", model="no-such-model"), "model"),
    (dict(text="hi", stop=[f"s{i}" for i in range(40)]), "stop"),
    (dict(text="hi", logprobs=21), "logprobs"),
    (dict(token_ids=[1, 2, 999_999]), "token_ids"),
    (dict(), "input"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_input_is_rejected_by_field(default_mesh, kwargs, field):
    async def main():
        async with VmeshClient(default_mesh.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(**kwargs)
            # ...and the mesh keeps serving.
            _text, ids, _ = await client.complete(text="Say yes.", max_tokens=2)
            return err.value, ids

    error, ids = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()
    assert len(ids) >= 1


def test_logprobs_stop_strings_and_modes_through_the_mesh(default_mesh):
    async def main():
        async with VmeshClient(default_mesh.address) as client:
            lp = await client.complete(text="The capital of France is", max_tokens=4, temperature=0, logprobs=3)
            stop = await client.complete(chat=[{"role": "user", "content": "Count from 1 to 10 with commas."}],
                                         max_tokens=60, temperature=0, stop=["5"])
            final = [o async for o in client.generate(text="Hello", max_tokens=5, temperature=0,
                                                      output_mode="final_only")]
            return lp, stop, final

    lp, stop, final = asyncio.run(main())
    last = lp[2]
    assert len(lp[1]) == 4
    stop_text, _ids, stop_last = stop
    assert "5" not in stop_text and stop_last.finish_reason == 1  # STOP
    assert len(final) >= 1 and all(not o.text for o in final[:-1]) and final[-1].text
    # logprobs: one entry per token, rank 1 under greedy, top-3 sorted.
    async def again():
        async with VmeshClient(default_mesh.address) as client:
            return [o async for o in client.generate(text="The capital of France is", max_tokens=4, temperature=0,
                                                     logprobs=3)]
    outs = asyncio.run(again())
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == 4
    for e in entries:
        assert e.rank == 1 and len(e.top) == 3 and e.top[0].logprob == pytest.approx(e.logprob, abs=1e-5)
    assert last.usage.completion_tokens == 4


async def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return reply.status


async def _first_status_besides(address: str, status: int) -> int:
    """The server's overall health once it is other than `status`, as the server announces it: a
    Watch, so no change is missed however briefly it lasts, and nothing is polled."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        async for reply in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()):
            if reply.status != status:
                return reply.status
    raise AssertionError("the health stream ended")


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) until the block ends, however it ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("stop", ["sigterm", "ctrl_c"])
def test_sigterm_drains_in_flight_requests(stop: str):
    """SIGTERM to the launcher, or Ctrl-C in its terminal (SIGINT to its whole process group, the
    services too): either way the mesh drains, frontend first, and the request in flight ends."""
    from grpc_health.v1 import health_pb2

    mesh = start_mesh()
    try:
        async def main():
            assert await _health(mesh.address) == health_pb2.HealthCheckResponse.SERVING
            async with VmeshClient(mesh.address) as client:
                stream = client.generate(text="Tell me a story", max_tokens=200, ignore_eos=True)
                outputs = [await stream.__anext__()]
                # Signalled late in the request, so that the drain's bounded grace (30 s) covers the
                # rest even on a loaded machine, with the worker paused: the request is still in
                # flight while health is asked however fast the model, and goes on when the worker does.
                while sum(len(o.token_ids) for o in outputs) < 150:
                    outputs.append(await stream.__anext__())
                with paused(mesh.services["worker"][1]):
                    stats = await asyncio.to_thread(scheduler_stats, mesh)
                    if stop == "sigterm":
                        mesh.process.send_signal(signal.SIGTERM)
                    else:  # start_mesh made the launcher a process group's leader, as a shell does
                        os.killpg(mesh.process.pid, signal.SIGINT)
                    # Draining: health says NOT_SERVING while the request still streams to the end.
                    draining = await asyncio.wait_for(
                        _first_status_besides(mesh.address, health_pb2.HealthCheckResponse.SERVING), BUDGET_S)
                outputs += [o async for o in stream]
                return stats, draining, outputs

        stats, draining, outputs = asyncio.run(main())
        assert stats.num_running == 1  # it was in flight when the mesh was told to stop
        assert draining == health_pb2.HealthCheckResponse.NOT_SERVING
        assert sum(len(o.token_ids) for o in outputs) == 200 and outputs[-1].finish_reason == 2
        assert mesh.process.wait(STOP_TIMEOUT_S) == 0  # and then the mesh stops by itself
    finally:
        mesh.stop()  # whatever happened above: a failure there is the one reported


def test_cli_generate_and_chat_stream_from_the_mesh(default_mesh):
    import subprocess
    import sys

    from tests.support.checkout import ROOT

    cli = [sys.executable, "-m", "vmesh", "--log-level", "WARNING"]
    generated = subprocess.run([*cli, "generate", "What is 2 + 2?", "--address", default_mesh.address,
                                "--max-tokens", "12"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()
    chat = subprocess.run([*cli, "chat", "--address", default_mesh.address, "--max-tokens", "8"], cwd=ROOT,
                          input="Hello there\nAnd again\n", capture_output=True, text=True, timeout=60)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("assistant> ") == 2


def _maps_torch(pid: int) -> bool:
    """Whether a process has torch loaded (its shared library mapped), read from outside."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_worker_loads_torch(default_mesh):
    """Frontends and detokenizers scale out, so each replica's size is multiplied: they tokenize
    with `tokenizers` alone. The scheduler has no use for torch either. (PSS is printed for the
    record; memory is measured in benchmarks, not asserted here.)"""
    loaded = {name: _maps_torch(pid) for name, (_address, pid) in default_mesh.services.items()}
    from vmesh.services.bench.memory import pss_mib

    print({name: f"{pss_mib(pid):.0f} MiB" for name, (_address, pid) in default_mesh.services.items()})
    assert loaded.pop("worker") is True  # the check sees torch where it is
    assert loaded and not any(loaded.values()), loaded


def _thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of a process (field 19 of /proc/<pid>/task/<tid>/stat)."""
    return {int(stat.read_text().rpartition(")")[2].split()[16]) for stat in Path(f"/proc/{pid}/task").glob("*/stat")}


def test_only_the_worker_runs_at_the_launcher_s_priority(default_mesh):
    """Every thread of the other services runs DEFAULT_SERVICE_NICENESS above the launcher (0 by
    default: equal), the worker's at the launcher's (the flag's effect: test_process_priority.py)."""
    from vmesh.services.process_priority import DEFAULT_SERVICE_NICENESS

    launcher = os.getpriority(os.PRIO_PROCESS, default_mesh.process.pid)
    niceness = {name: _thread_niceness(pid) for name, (_address, pid) in default_mesh.services.items()}
    assert niceness.pop("worker") == {launcher}
    assert niceness and all(n == {min(19, launcher + DEFAULT_SERVICE_NICENESS)} for n in niceness.values()), niceness


def test_health_checks_do_not_import_torch(default_mesh):
    import subprocess
    import sys

    from tests.support.checkout import ROOT

    script = ("import sys\nfrom vmesh.services.cli import main\n"
              f"code = main(['health', {default_mesh.address!r}])\n"
              "print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["0", "False"], result.stdout + result.stderr
