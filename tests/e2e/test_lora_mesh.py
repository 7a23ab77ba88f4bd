"""LoRA adapters over a mesh of two scheduler groups: one given at start, one loaded at run time
through vLLM's endpoint, selected by `model` on both APIs; a load that fails on one group is
rolled back on the other and says where; unknown names are vLLM's 404 model_not_found."""

from __future__ import annotations

import asyncio
import re

import grpc
import httpx
import pytest

from tests.e2e.conftest import scheduler_stats
from tests.support.lora_adapters import RECIPES, assert_peft_greedy, make_peft_model
from tests.support.meshes import stops_cleanly
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.v1 import common_pb2, scheduler_pb2_grpc

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(embedded_model_dir, tmp_path_factory):
    return make_peft_model(embedded_model_dir, tmp_path_factory.mktemp("adapters"), RECIPES[:2])


async def _greedy(address: str, prompt: list[int], model: str) -> list[int]:
    async with VmeshClient(address) as client:
        _text, ids, _last = await client.complete(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True, model=model)
    return ids


def _load_on_one_group(mesh, group: str, name: str, path: str) -> None:
    async def load():
        async with mesh.channel(group) as ch:
            await scheduler_pb2_grpc.SchedulerServiceStub(ch).LoadLoraAdapter(
                common_pb2.LoraAdapterRequest(lora_name=name, lora_path=path), timeout=60)

    asyncio.run(load())


def test_adapters_across_two_groups(adapters, chat_prompt_ids):
    peft_model, paths = adapters
    prompt, poet_prompt = chat_prompt_ids[3], chat_prompt_ids[1]  # prompts each adapter changes
    with stops_cleanly(start_mesh("--data-parallel-size", "2", "--lora-modules", f"sql={paths['sql']}",
                                  "--allow-runtime-lora-updating", "--max-loras", "2")) as mesh:
        http = httpx.Client(base_url=mesh.http_url, timeout=120)
        base_name = http.get("/models").json()["data"][0]["id"]
        listed = http.get("/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(base_name, None), ("sql", base_name)]

        loaded = http.post("/load_lora_adapter", json={"lora_name": "poet", "lora_path": paths["poet"]})
        assert loaded.status_code == 200, loaded.text
        assert "poet" in [m["id"] for m in http.get("/models").json()["data"]]
        # Each group took it, on its worker: every scheduler lists it.
        assert all("poet" in scheduler_stats(mesh, g).lora_adapters for g in ("scheduler-0", "scheduler-1"))

        # gRPC: several requests per adapter, spread over both groups, are peft's tokens.
        cases = [(p, name) for p, name in ((prompt, ""), (poet_prompt, ""), (prompt, "sql"), (poet_prompt, "poet"))
                 for _ in range(2)]

        async def all_greedy():
            return await asyncio.gather(*(_greedy(mesh.address, p, name) for p, name in cases))

        outputs = asyncio.run(all_greedy())
        assert_peft_greedy(peft_model, [(p, out, name) for (p, name), out in zip(cases, outputs)])
        assert outputs[0] != outputs[4] and outputs[2] != outputs[6]
        # HTTP: the same tokens' text, the adapter's name echoed as the model.
        body = http.post("/completions", json={"model": "sql", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                "temperature": 0, "ignore_eos": True}).json()
        assert body["model"] == "sql"

        missing = http.post("/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        # A load that one group refuses (it already holds the name) is undone on the other, whichever
        # came first in the frontend's order (the rollback itself: test_lora_units.py).
        _load_on_one_group(mesh, "scheduler-1", "chef", paths["sql"])
        refused = http.post("/load_lora_adapter", json={"lora_name": "chef", "lora_path": paths["sql"]})
        assert refused.status_code == 400, refused.text
        assert re.search(r"failed on scheduler group [01]: a LoRA adapter named 'chef' is already loaded",
                         refused.json()["error"]["message"]), refused.text
        assert "chef" not in scheduler_stats(mesh, "scheduler-0").lora_adapters
        assert "chef" not in [m["id"] for m in http.get("/models").json()["data"]]
        bad_path = http.post("/load_lora_adapter", json={"lora_name": "ghost", "lora_path": "/nonexistent"})
        assert bad_path.status_code == 400 and "no adapter_config.json" in bad_path.json()["error"]["message"]

        assert http.post("/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        assert "poet" not in [m["id"] for m in http.get("/models").json()["data"]]
        gone = http.post("/unload_lora_adapter", json={"lora_name": "poet"})
        assert gone.status_code == 404
        http.close()
        # The public gRPC API's load and unload: the same one operation for the mesh, the same refusals.
        assert asyncio.run(_over_grpc(mesh, paths["poet"])) == (["poet", "sql"], grpc.StatusCode.INVALID_ARGUMENT,
                                                                 ["sql"], grpc.StatusCode.NOT_FOUND)
        assert all("poet" not in scheduler_stats(mesh, g).lora_adapters for g in ("scheduler-0", "scheduler-1"))


async def _over_grpc(mesh, path: str) -> tuple[list[str] | grpc.StatusCode, ...]:
    """Load `path` as poet, load it again (refused), unload it, unload it again (refused)."""
    async with VmeshClient(mesh.address) as client:
        async def call(rpc, name: str, lora_path: str = "") -> list[str] | grpc.StatusCode:
            try:
                reply = await rpc(common_pb2.LoraAdapterRequest(lora_name=name, lora_path=lora_path), timeout=120)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return sorted(reply.lora_adapters)

        loaded = await call(client.stub.LoadLoraAdapter, "poet", path)
        twice = await call(client.stub.LoadLoraAdapter, "poet", path)
        unloaded = await call(client.stub.UnloadLoraAdapter, "poet")
        return loaded, twice, unloaded, await call(client.stub.UnloadLoraAdapter, "poet")
