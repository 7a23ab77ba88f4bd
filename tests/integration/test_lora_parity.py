"""LoRA adapters on the embedded model: greedy tokens equal peft's for seeded random adapters, with
four adapters and the base model in one batch (ragged, chunked prefill, late joiners), and each
request gets alone the tokens it gets in the mix, also when adapters swap through fewer slots."""

from __future__ import annotations

import pytest

from tests.support.lora_adapters import RECIPES, assert_peft_greedy, make_peft_model
from tests.support.plan_driver import DrivenRequest, drive
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.lora import LoraStepError
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.persistent_batch import PlanError

MAX_TOKENS = 6
ADAPTERS = [recipe.name for recipe in RECIPES]


@pytest.fixture(scope="module")
def adapters(embedded_model_dir, tmp_path_factory):
    return make_peft_model(embedded_model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def runner(embedded_model_dir, adapters):
    _peft_model, paths = adapters
    modules = [f"{name}={path}" for name, path in paths.items()]
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=32 << 20, max_num_seqs=16,
                                         lora_modules=modules, max_loras=4, max_lora_rank=16))


def _run(runner: ModelRunner, requests: list[DrivenRequest], chunk: int = 1 << 30) -> list[list[int]]:
    drive(runner, requests, chunk=chunk, step_offset=runner.last_step + 1)
    return [r.output for r in requests]


@pytest.fixture(scope="module")
def mixed(runner, chat_prompt_ids):
    """Each adapter on its own prompt and the base model on all of them, in one batch, joining over 4 steps."""
    prompts = [chat_prompt_ids[i] for i in (3, 1, 6, 9)]
    cases = [(p, "") for p in prompts] + list(zip(prompts, ADAPTERS))
    requests = [DrivenRequest(p, MAX_TOKENS, lora_name=name, join_step=i % 4) for i, (p, name) in enumerate(cases)]
    return cases, _run(runner, requests, chunk=16)


def test_mixed_batch_matches_peft(adapters, mixed):
    peft_model, _paths = adapters
    cases, outputs = mixed
    assert_peft_greedy(peft_model, [(p, out, name) for (p, name), out in zip(cases, outputs)])
    base, adapted = outputs[:len(ADAPTERS)], outputs[len(ADAPTERS):]
    assert all(a != b for a, b in zip(adapted, base)), f"every adapter changes its prompt's tokens: {outputs}"


def test_each_request_alone_gets_its_mixed_tokens_through_swapped_slots(runner, adapters, mixed):
    """A fifth adapter (the first one's files under another name) makes four slots too few: the
    requests run one at a time, so slots are taken over in LRU order, and nothing changes."""
    _peft_model, paths = adapters
    lora = runner.lora
    lora.load("sql-copy", paths["sql"])
    try:
        cases, outputs = mixed
        sql = cases.index((cases[0][0], "sql"))
        copy_alone = _run(runner, [DrivenRequest(cases[sql][0], MAX_TOKENS, lora_name="sql-copy")])[0]
        assert copy_alone == outputs[sql]  # equal files: equal tokens
        assert len(lora.slot_of_id) == 4  # one of the four went back to host memory for it
        # The base model once, then each adapter: every adapter comes back into a slot it lost.
        chosen = [len(ADAPTERS) - 1, *range(len(ADAPTERS), len(cases))]
        alone = [_run(runner, [DrivenRequest(cases[i][0], MAX_TOKENS, lora_name=cases[i][1])])[0] for i in chosen]
        assert alone == [outputs[i] for i in chosen]
        # The four were used after the copy: it is the one left out.
        assert set(lora.slot_of_id) == {lora.id_of_name[name] for name in ADAPTERS}
    finally:
        lora.unload("sql-copy")


def test_unknown_adapter_and_too_many_adapters_are_refused(runner, chat_prompt_ids):
    step = runner.last_step + 1
    prompt = chat_prompt_ids[0]
    plan = StepPlan(step=step, new_requests=[NewRequest(0, prompt, len(prompt), SamplingParams(), [0, 1, 2],
                                                        lora_name="nope")])
    with pytest.raises(PlanError, match="no adapter named 'nope'"):
        runner.execute(plan)
    runner.reset()
    lora = runner.lora
    lora.max_loras = 3  # four adapters in one step, three slots
    try:
        requests = [NewRequest(i, prompt, len(prompt), SamplingParams(), [3 * i, 3 * i + 1, 3 * i + 2],
                               lora_name=name) for i, name in enumerate(ADAPTERS)]
        plan = StepPlan(step=0, new_requests=requests, scheduled_handles=[0, 1, 2, 3],
                        num_scheduled_tokens=[len(prompt)] * 4)
        with pytest.raises(LoraStepError, match="a step uses 4 adapters; this worker has --max-loras 3"):
            runner.execute(plan)
    finally:
        lora.max_loras = 4
        runner.reset()
