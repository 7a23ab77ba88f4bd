"""The worker enforcing grammars, driven by the real scheduler over a model runner whose model
returns random logits (the embedded tokenizer's vocabulary): outputs follow their grammars and
end with EOS at depth 1 and 2, max_tokens mid-structure is `length`, and a matcher that fails
(a payload that does not load, a rejected token, a raising mask fill, an uncompiled request)
fails its own request with a message while the rest of the batch runs on."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import tokenizers
import torch

from vmesh.services.common.kv_cache_groups import single_group_layout
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import CompiledGrammar, FinishReason, SamplingParams, StructuredOutput
from vmesh.services.common.wire.step import result_from_proto, result_to_proto
from vmesh.services.engine.core import EngineCore
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import MAX_PLAN_GRAMMAR_BYTES, Scheduler, WorkerGeometry
from vmesh.services.scheduler.settings import SchedulerSettings
from vmesh.services.worker import grammar_rows
from vmesh.services.worker.model_runner import ModelRunner

VOCAB_SIZE = 49152
EOS = 2
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}}}
REGEX = r"[a-c]{2}\d(-x)?"
PROMPT = [1, 7, 9, 11]


class RandomLogitsModel:
    """A model whose logits are random (seeded): a grammar alone keeps its output well-formed."""

    def __init__(self, seed: int = 0):
        self.spec = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_ids=(EOS,))
        self.device = torch.device("cpu")
        self.parallel = None
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, positions, attention, kv_cache, backend, logits_indices):
        return torch.randn(len(logits_indices), VOCAB_SIZE, generator=self.generator) * 3


@pytest.fixture(scope="module")
def decode(grammar_tokenizer):
    tokenizer = tokenizers.Tokenizer.from_file(str(grammar_tokenizer.tokenizer_json))
    return lambda ids: tokenizer.decode([t for t in ids if t != EOS])


def make_runner(grammar_tokenizer, seed: int = 0) -> ModelRunner:
    kv_cache = SimpleNamespace(block_size=16, num_blocks=256, num_groups=1, layout=single_group_layout(1))
    return ModelRunner(RandomLogitsModel(seed), kv_cache, None, 8, 512, grammar_tokenizer)  # type: ignore[arg-type]


def run(runner: ModelRunner, requests: list[tuple[str, SamplingParams]], depth: int = 2):
    """Every request to its end: {request id: (tokens, finish reason, error)}."""
    scheduler = Scheduler.for_worker(SchedulerSettings(), WorkerGeometry(512, 8, 256, 16, (EOS,)))
    core = EngineCore(scheduler, runner, depth)
    outputs: dict[str, tuple[list[int], FinishReason | None, str]] = {}
    for request_id, params in requests:
        scheduler.add_request(Request(request_id, list(PROMPT), params))
        outputs[request_id] = ([], None, "")
    while core.has_work():
        for update in core.step():
            tokens, _, _ = outputs[update.request_id]
            outputs[update.request_id] = (tokens + update.new_token_ids, update.finish_reason, update.error)
    core.shutdown()
    return outputs


def constrained(compiler, kind: str, source: str, backend: str = "auto", **sampling) -> SamplingParams:
    return SamplingParams(grammar=compiler.compile(StructuredOutput(kind, source, backend)),
                          **{"max_tokens": 60, **sampling})


SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 11},
             "temperature": {"temperature": 1.2, "top_k": 50, "top_p": 0.9}}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_outputs_follow_their_grammars_and_end_with_eos(compiler, grammar_tokenizer, decode, depth, sampling,
                                                        backend) -> None:
    runner = make_runner(grammar_tokenizer, seed=depth)
    schema = constrained(compiler, "json_schema", json.dumps(SCHEMA), backend, **SAMPLINGS[sampling])
    regex = constrained(compiler, "regex", REGEX, backend, **SAMPLINGS[sampling])
    outputs = run(runner, [("schema", schema), ("regex", regex), ("free", SamplingParams(max_tokens=5))], depth)
    for request_id in ("schema", "regex"):
        tokens, reason, error = outputs[request_id]
        assert (reason, error) == (FinishReason.STOP, ""), request_id
        assert tokens[-1] == EOS and EOS not in tokens[:-1], request_id
    # strict=False: xgrammar's JSON strings admit raw control characters other than CR and LF,
    # which strict JSON rejects, and random logits draw them (a real model rarely does).
    jsonschema.validate(json.loads(decode(outputs["schema"][0]), strict=False), SCHEMA)
    assert re.fullmatch(REGEX, decode(outputs["regex"][0]))
    assert outputs["free"][1] is FinishReason.LENGTH and len(outputs["free"][0]) == 5


def test_eos_ends_a_constrained_request_despite_ignore_eos_and_min_tokens(compiler, grammar_tokenizer) -> None:
    """The grammar decides where its output ends: min_tokens does not ban EOS where only EOS is allowed."""
    params = constrained(compiler, "choice", '["ab"]', temperature=0, ignore_eos=True, min_tokens=20)
    tokens, reason, error = run(make_runner(grammar_tokenizer), [("r", params)])["r"]
    assert (reason, error, tokens[-1]) == (FinishReason.STOP, "", EOS) and len(tokens) < 20


def test_max_tokens_mid_structure_finishes_with_length(compiler, grammar_tokenizer, decode) -> None:
    params = constrained(compiler, "json_schema", json.dumps(SCHEMA), temperature=0, max_tokens=3)
    tokens, reason, error = run(make_runner(grammar_tokenizer), [("r", params)])["r"]
    assert (reason, error, len(tokens)) == (FinishReason.LENGTH, "", 3) and decode(tokens).startswith("{")


def broken_requests(compiler) -> list[tuple[str, SamplingParams]]:
    good = constrained(compiler, "regex", REGEX, temperature=0)
    return [("good", good), ("free", SamplingParams(temperature=0, max_tokens=6)),
            ("bad-payload", SamplingParams(grammar=CompiledGrammar("xgrammar", "0" * 64, b"{not a grammar"))),
            ("bad-backend", SamplingParams(grammar=CompiledGrammar("nonesuch", "1" * 64, b"{}"))),
            ("uncompiled", SamplingParams(structured=StructuredOutput("regex", "a+")))]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_matcher_that_cannot_load_fails_only_its_request(compiler, grammar_tokenizer, decode, depth) -> None:
    outputs = run(make_runner(grammar_tokenizer), broken_requests(compiler), depth)
    assert outputs["good"][1] is FinishReason.STOP and re.fullmatch(REGEX, decode(outputs["good"][0]))
    assert outputs["free"][1] is FinishReason.LENGTH and len(outputs["free"][0]) == 6
    for request_id, message in (("bad-payload", "the request's xgrammar grammar does not load"),
                                ("bad-backend", "unknown grammar backend 'nonesuch'"),
                                ("uncompiled", "structured output reached the worker uncompiled")):
        tokens, reason, error = outputs[request_id]
        assert (tokens, reason) == ([], FinishReason.ABORT) and message in error, request_id


class RejectingMatcher:
    """A real matcher that rejects (or raises on) the output's third token: a bug the worker survives."""

    def __init__(self, matcher, mode: str):
        self.matcher, self.mode, self.seen = matcher, mode, 0

    def fill_bitmask(self, bitmask, row):
        if self.mode == "fill" and self.seen == 2:
            raise RuntimeError("mask fill exploded")
        self.matcher.fill_bitmask(bitmask, row)

    def accept(self, token_id):
        self.seen += 1
        if self.seen == 3 and self.mode == "reject":
            return False
        if self.seen == 3 and self.mode == "raise":
            raise RuntimeError("accept exploded")
        return self.matcher.accept(token_id)

    def is_terminated(self):
        return self.matcher.is_terminated()

    def rollback(self, num_tokens):
        self.matcher.rollback(num_tokens)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode, message", [("reject", "the grammar matcher rejected token"),
                                           ("raise", "accept exploded"), ("fill", "mask fill exploded")])
def test_a_matcher_failing_mid_request_fails_only_its_request(compiler, grammar_tokenizer, decode, monkeypatch,
                                                              depth, mode, message) -> None:
    real_load = grammar_rows.load_matcher
    failing_key = compiler.compile(StructuredOutput("json_schema", json.dumps(SCHEMA))).key

    def load(grammar, *args):
        matcher = real_load(grammar, *args)
        return RejectingMatcher(matcher, mode) if grammar.key == failing_key else matcher

    monkeypatch.setattr(grammar_rows, "load_matcher", load)
    requests = [("failing", constrained(compiler, "json_schema", json.dumps(SCHEMA), temperature=0)),
                ("good", constrained(compiler, "regex", REGEX, temperature=0))]
    outputs = run(make_runner(grammar_tokenizer), requests, depth)
    tokens, reason, error = outputs["failing"]
    assert reason is FinishReason.ABORT and message in error
    assert len(tokens) == 2, "the tokens before the failure were delivered, the failing one was not"
    assert outputs["good"][1] is FinishReason.STOP and re.fullmatch(REGEX, decode(outputs["good"][0]))


def test_failures_cross_the_wire() -> None:
    result = StepResult(step=3, handles=[1], sampled_token_ids=[5], failed_handles=[2, 4],
                        failure_messages=["rejected", "does not load"])
    assert result_from_proto(result_to_proto(result)) == result


def test_a_plan_admits_new_constrained_requests_within_the_grammar_byte_budget() -> None:
    scheduler = Scheduler.for_worker(SchedulerSettings(), WorkerGeometry(512, 16, 256, 16, (EOS,)))
    payload = b"x" * (MAX_PLAN_GRAMMAR_BYTES // 3 + 1)  # three do not fit one plan
    for i in range(5):
        grammar = CompiledGrammar("llguidance", f"{i:064d}", payload)
        scheduler.add_request(Request(f"r{i}", list(PROMPT), SamplingParams(grammar=grammar)))
    sizes = []
    while scheduler.waiting:
        plan = scheduler.schedule()
        assert plan is not None
        sizes.append(len(plan.new_requests))
    assert sizes == [2, 2, 1]
    huge = CompiledGrammar("llguidance", "f" * 64, b"x" * (MAX_PLAN_GRAMMAR_BYTES + 1))
    scheduler.add_request(Request("huge", list(PROMPT), SamplingParams(grammar=huge)))
    plan = scheduler.schedule()
    assert plan is not None and len(plan.new_requests) == 1, "a plan's first request is always admitted"
