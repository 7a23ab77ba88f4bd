"""Structured outputs through the in-process engine with the embedded model: JSON schemas, a
regex and a choice, greedy and sampled, every output valid; greedy constrained output identical
at pipeline depth 1 and 2, after preemption, and from the stateless worker (its full-state plans
executed by the worker's own servicer at depth 1 and 2); refusals named as the mesh names them."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.support.schema_corpus import assert_valid
from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.types import CompiledGrammar, FinishReason, SamplingParams, StructuredOutput
from vmesh.services.common.wire.step import result_from_proto, result_to_proto
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler, WorkerGeometry
from vmesh.services.scheduler.settings import SchedulerSettings
from vmesh.services.scheduler.worker_ranks import plan_message
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.persistent_batch import PersistentBatch
from vmesh.services.worker.server import WorkerServicer

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                              "age": {"type": "integer", "minimum": 0, "maximum": 130},
                              "email": {"type": "string", "format": "email", "maxLength": 40}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["items", "status"],
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                  "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                  "status": {"enum": ["open", "paid", "shipped"]}}},
    "event": {"$defs": {"day": {"type": "string", "format": "date"}}, "type": "object", "additionalProperties": False,
              "required": ["title", "on"], "properties": {"title": {"type": "string", "maxLength": 30},
                                                          "on": {"$ref": "#/$defs/day"},
                                                          "online": {"type": "boolean"}}},
    "answer": {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["ok"],
                          "properties": {"ok": {"const": True}}},
                         {"type": "object", "additionalProperties": False, "required": ["error"],
                          "properties": {"error": {"type": "string", "maxLength": 20}}}]},
}
PROMPT = "Reply with JSON only: a {name} record."
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=64 << 20, max_num_seqs=16))


def make_engine(runner, tokenizer, *, depth=2, num_blocks=None) -> LLMEngine:
    """An engine over the shared runner, with a fresh batch (its grammar tokenizer kept) and scheduler."""
    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks, runner.batch.grammar_tokenizer)
    runner.last_step = -1
    saved = runner.kv_cache.num_blocks
    if num_blocks is not None:
        runner.kv_cache.num_blocks = num_blocks  # the scheduler only hands out the first num_blocks
    try:
        return LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=256, pipeline_depth=depth))
    finally:
        runner.kv_cache.num_blocks = saved


def schema_requests(engine: LLMEngine, **sampling) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [engine.encode_chat([{"role": "user", "content": PROMPT.format(name=name)}]) for name in SCHEMAS]
    params = [SamplingParams(max_tokens=120, structured=StructuredOutput("json_schema", json.dumps(schema)),
                             **sampling) for schema in SCHEMAS.values()]
    return prompts, params


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5},
                                      {"temperature": 1.0, "top_p": 0.9}], ids=["greedy", "seeded", "temperature"])
def test_schema_outputs_validate(runner, embedded_tokenizer, sampling) -> None:
    engine = make_engine(runner, embedded_tokenizer)
    outputs = engine.generate(*schema_requests(engine, **sampling))
    for schema, out in zip(SCHEMAS.values(), outputs):
        assert out.finish_reason is FinishReason.STOP and not out.error, out
        assert_valid(schema, out.text)
    engine.shutdown()


def test_regex_choice_and_grammar_outputs_match(runner, embedded_tokenizer) -> None:
    engine = make_engine(runner, embedded_tokenizer)
    prompt = engine.encode_chat([{"role": "user", "content": "Pick a month and a colour."}])
    kinds = [("regex", REGEX), ("choice", json.dumps(CHOICES)), ("grammar", 'root ::= "(" [0-9]{1,2} ")" | "none"')]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=20, structured=StructuredOutput(kind, source))
              for kind, source in kinds for t in (0, 1.0)]
    outputs = engine.generate([prompt] * len(params), params)
    for i, out in enumerate(outputs):
        assert out.finish_reason is FinishReason.STOP and not out.error, out
        kind = kinds[i // 2][0]
        if kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
        elif kind == "choice":
            assert out.text in CHOICES
        else:
            assert re.fullmatch(r"\([0-9]{1,2}\)|none", out.text), out.text
    engine.shutdown()


def stateless_outputs(runner, prompts: list[list[int]], params: list[SamplingParams], depth: int) -> list[list[int]]:
    """The stateless worker's protocol without a network: the scheduler's full-state plans, as they
    travel, executed by the worker's servicer (which rebuilds its batch from each)."""
    runner.reset()
    servicer = WorkerServicer(runner, "embedded")
    geometry = WorkerGeometry(runner.max_model_len, runner.batch.max_num_reqs, runner.kv_cache.num_blocks,
                              runner.kv_cache.block_size, tuple(runner.spec.eos_token_ids))
    scheduler = Scheduler.for_worker(SchedulerSettings(max_num_batched_tokens=256), geometry)
    pipeline = StepPipeline(scheduler, depth)
    tokens: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(Request(f"r{i}", prompt, sp))
        tokens[f"r{i}"] = []
    in_flight = []
    while pipeline.has_work():
        in_flight += [servicer._execute(plan_message(plan, scheduler, full_state=True), time.perf_counter())
                      for plan in pipeline.plans()]
        for update in pipeline.complete(result_from_proto(result_to_proto(in_flight.pop(0)))):
            assert not update.error, update.error
            tokens[update.request_id] += update.new_token_ids
    servicer.executor.shutdown()
    runner.reset()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_greedy_output_is_identical_in_every_mode(runner, embedded_tokenizer) -> None:
    engine = make_engine(runner, embedded_tokenizer, depth=1)
    prompts, params = schema_requests(engine, temperature=0)
    compiled = [engine._compiled(p) for p in params]
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    engine.shutdown()
    for schema, ids in zip(SCHEMAS.values(), expected):
        assert_valid(schema, embedded_tokenizer.decode(ids, skip_special_tokens=True))
    engine = make_engine(runner, embedded_tokenizer, depth=2)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected, "depth 2"
    engine.shutdown()
    engine = make_engine(runner, embedded_tokenizer, depth=2, num_blocks=12)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected, "after preemption"
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    engine.shutdown()
    for depth in (1, 2):
        assert stateless_outputs(runner, prompts, compiled, depth) == expected, f"stateless, depth {depth}"


def test_refusals_name_the_field(runner, embedded_tokenizer) -> None:
    engine = make_engine(runner, embedded_tokenizer)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([1, 2], SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema))))
    assert refused.value.field == "sampling.structured.properties.tags.uniqueItems"
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([1, 2], SamplingParams(structured=StructuredOutput("regex", "(unclosed")))
    assert refused.value.field == "sampling.structured" and "regex" in refused.value.detail
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([1, 2], SamplingParams(grammar=CompiledGrammar("xgrammar", "0" * 64, b"{}")))
    assert refused.value.field == "sampling.grammar"
    assert not engine.has_unfinished()
    engine.shutdown()
