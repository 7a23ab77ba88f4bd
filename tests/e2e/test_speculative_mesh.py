"""Speculative decoding through the whole mesh: `vmesh serve --speculative-config` forwards the
setting to the worker, the scheduler learns it from GetWorkerInfo, greedy outputs match
transformers' on the held chat prompts and on a text to copy, and the scheduler's spec_decode
counters account for the drafts."""

from __future__ import annotations

import asyncio
import json

from tests.e2e.conftest import wait_idle
from tests.support.meshes import stops_cleanly
from tests.support.reference import assert_greedy_match, hf_greedy
from tests.support.scrape import scrape
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.tokenizer import encode_chat

# Drafts at any batch size (0), so that every request of the test verifies some.
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4, "disable_by_batch_size": 0})
COPY = ("Repeat this text exactly: All that glitters is not gold. A journey of a thousand miles begins with a "
        "single step.")


async def _greedy_all(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with VmeshClient(address) as client:
        results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True) for p in prompts))
    return [ids for _text, ids, _last in results]


def test_speculative_mesh_keeps_greedy_outputs(chat_prompt_ids, reference_outputs, embedded_reference_model,
                                               embedded_tokenizer):
    copy_prompt = encode_chat(embedded_tokenizer, [{"role": "user", "content": COPY}])
    copy_reference = hf_greedy(embedded_reference_model, copy_prompt, 32)
    with stops_cleanly(start_mesh("--metrics", "--speculative-config", SPECULATIVE)) as mesh:
        outputs = asyncio.run(_greedy_all(mesh.address, [*chat_prompt_ids, copy_prompt], 32))
        for i, ids in enumerate(outputs[:-1]):
            assert_greedy_match(ids, reference_outputs[i], label=f"speculative mesh prompt {i}")
        assert_greedy_match(outputs[-1], copy_reference, label="copied text")
        assert wait_idle(mesh).num_used_blocks == 0
        scheduler = scrape(mesh.metrics["scheduler"])
        drafts = scheduler["vmesh:spec_decode_num_draft_tokens_total"]
        accepted = scheduler["vmesh:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= drafts
        assert scheduler['vmesh:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0


def test_suffix_drafts_from_recent_outputs_through_the_mesh(chat_prompt_ids, reference_outputs):
    """`suffix_decoding_max_cached_requests` through `vmesh serve`: asked the held prompts a second
    time, the worker drafts from the first answers (the prompts do not hold them), so most drafts
    are accepted, and greedy outputs still match transformers'."""
    config = json.dumps({"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 0,
                         "suffix_decoding_max_cached_requests": 32})
    with stops_cleanly(start_mesh("--metrics", "--speculative-config", config)) as mesh:
        accepted = []
        for round_ in ("first", "again"):
            for i, ids in enumerate(asyncio.run(_greedy_all(mesh.address, chat_prompt_ids, 32))):
                assert_greedy_match(ids, reference_outputs[i], label=f"{round_} round, prompt {i}")
            assert wait_idle(mesh).num_used_blocks == 0
            accepted.append(scrape(mesh.metrics["scheduler"])["vmesh:spec_decode_num_accepted_tokens_total"])
        again = accepted[1] - accepted[0]
        assert again >= 0.5 * 31 * len(chat_prompt_ids), accepted  # 31 decodes a prompt, most now drafted
        assert again > 2 * accepted[0], accepted
