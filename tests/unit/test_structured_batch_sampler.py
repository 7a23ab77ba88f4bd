"""Grammar matchers in the persistent batch (built on add, replaying the outputs a request has,
moved with their rows, kept across the stateless rebuild) and the sampler under a token mask
(no masked token is ever drawn, greedy, seeded or at a temperature, with top-k / top-p / min-p,
penalties and min-tokens bans; unmasked rows and logprobs are untouched)."""

from __future__ import annotations

import pytest
import tokenizers
import torch

from tests.support.factories import make_sampling_batch
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.structured import allocate_token_bitmask, load_matcher
from vmesh.services.common.types import SamplingParams, StructuredOutput
from vmesh.services.worker.persistent_batch import PersistentBatch
from vmesh.services.worker.sampler import Sampler

VOCAB_SIZE = 49152
EOS = 2
SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"], '
          '"additionalProperties": false}')
PROMPT = [1, 5, 9]


@pytest.fixture(scope="module")
def encode(grammar_tokenizer):
    tokenizer = tokenizers.Tokenizer.from_file(str(grammar_tokenizer.tokenizer_json))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def params_for(compiler, backend: str = "xgrammar") -> SamplingParams:
    return SamplingParams(temperature=0, grammar=compiler.compile(StructuredOutput("json_schema", SCHEMA, backend)))


def expected_mask(compiler, grammar_tokenizer, params: SamplingParams, outputs: list[int]) -> torch.Tensor:
    """The mask of a fresh matcher that accepted `outputs`."""
    assert params.grammar is not None
    matcher = load_matcher(params.grammar, grammar_tokenizer.tokenizer_json, VOCAB_SIZE, [EOS])
    for token in outputs:
        assert matcher.accept(token)
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def row_mask(batch: PersistentBatch, handle: int) -> torch.Tensor:
    grammar = batch.grammars[batch.row_of_handle[handle]]
    assert grammar is not None and grammar.matcher is not None
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    grammar.matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def new_batch(grammar_tokenizer) -> PersistentBatch:
    return PersistentBatch(4, 64, 4, torch.device("cpu"), 64, grammar_tokenizer)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_added_rows_replay_their_outputs_and_matchers_move_with_rows(compiler, grammar_tokenizer, encode,
                                                                     backend: str) -> None:
    batch = new_batch(grammar_tokenizer)
    params = params_for(compiler, backend)
    outputs = {10: [], 11: encode('{"name": "a'), 12: encode('{"na')}
    batch.add(NewRequest(10, PROMPT, 3, params, [0]))
    batch.add(NewRequest(11, PROMPT + outputs[11], 3, params, [1, 2, 3]))
    batch.add(NewRequest(12, PROMPT + outputs[12], 3, SamplingParams(), [4, 5]))  # no grammar
    batch.add(NewRequest(13, PROMPT + outputs[12], 3, params, [6, 7]))
    assert batch.num_grammars == 3 and batch.grammars[batch.row_of_handle[12]] is None
    for handle, tokens in ((10, []), (11, outputs[11]), (13, outputs[12])):
        assert torch.equal(row_mask(batch, handle), expected_mask(compiler, grammar_tokenizer, params, tokens))
    batch.remove(10)  # the last row (13) moves into row 0, its matcher with it
    assert batch.row_of_handle[13] == 0 and batch.num_grammars == 2
    assert torch.equal(row_mask(batch, 13), expected_mask(compiler, grammar_tokenizer, params, outputs[12]))
    assert batch.grammars[3] is None


def test_a_kept_matcher_is_reused_and_synced_on_the_next_add(compiler, grammar_tokenizer, encode) -> None:
    """The stateless rebuild: the same handle re-added with more outputs advances the kept matcher;
    with outputs that differ from what it accepted, it rolls back to where they agree."""
    batch = new_batch(grammar_tokenizer)
    params = params_for(compiler)
    first = encode('{"name": "')
    batch.add(NewRequest(7, PROMPT + first, 3, params, [0, 1, 2]))
    kept = batch.grammars[0]
    batch.remove(7, keep_grammar=True)
    more = first + encode("bob")
    batch.add(NewRequest(7, PROMPT + more, 3, params, [0, 1, 2, 3]))
    assert batch.grammars[0] is kept and kept is not None and kept.accepted == more
    assert torch.equal(row_mask(batch, 7), expected_mask(compiler, grammar_tokenizer, params, more))
    batch.remove(7, keep_grammar=True)
    other = first + encode("al")
    batch.add(NewRequest(7, PROMPT + other, 3, params, [0, 1, 2, 3]))
    assert batch.grammars[0] is kept and kept.accepted == other and not kept.error
    assert torch.equal(row_mask(batch, 7), expected_mask(compiler, grammar_tokenizer, params, other))
    batch.remove(7, keep_grammar=True)
    batch.apply(StepPlan(step=0))
    assert not batch.spare_grammars, "a kept matcher nobody re-adds is dropped after the plan's adds"


def test_replaying_an_output_the_grammar_rejects_fails_the_row_not_the_batch(compiler, grammar_tokenizer,
                                                                             encode) -> None:
    batch = new_batch(grammar_tokenizer)
    batch.add(NewRequest(1, PROMPT + encode("not json"), 3, params_for(compiler), [0, 1, 2]))
    grammar = batch.grammars[0]
    assert grammar is not None and "rejected token" in grammar.error and not grammar.active


# --- the sampler under a mask ----------------------------------------------------------------




def random_bitmask(rows: int, vocab: int, generator: torch.Generator, allowed: int) -> torch.Tensor:
    """A packed bitmask allowing `allowed` random tokens of each row (never the row's argmax, usually)."""
    bitmask = torch.zeros((rows, -(-vocab // 32)), dtype=torch.int32)
    for row in range(rows):
        for token in torch.randperm(vocab, generator=generator)[:allowed].tolist():
            bitmask[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    return bitmask


def is_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("mode", ["greedy", "seeded", "temperature", "top-k", "top-p", "min-p", "penalties",
                                  "min-tokens"])
def test_no_masked_token_is_ever_sampled(mode: str) -> None:
    vocab, rows = 300, 4
    generator = torch.Generator().manual_seed(5)
    sampler = Sampler()
    for trial in range(60):
        logits = torch.randn(rows, vocab, generator=generator) * 4
        bitmask = random_bitmask(rows, vocab, generator, allowed=1 + trial % 7)
        columns: dict = {"temperature": torch.zeros(rows) if mode == "greedy" else torch.full((rows,), 1.5)}
        if mode == "seeded":
            columns.update(generators=[torch.Generator() for _ in range(rows)], seeds=[trial] * rows)
        if mode == "top-k":
            columns["top_k"] = torch.full((rows,), 3, dtype=torch.int64)
        if mode == "top-p":
            columns["top_p"] = torch.full((rows,), 0.5)
        if mode == "min-p":
            columns["min_p"] = torch.full((rows,), 0.2)
        batch = make_sampling_batch(rows, **columns, token_bitmask=bitmask, bitmask_rows=list(range(rows)))
        if mode == "penalties":
            batch.repetition_penalty = torch.full((rows,), 1.3)
            batch.frequency_penalty = torch.full((rows,), 0.5)
            batch.seen_token_ids = batch.output_token_ids = torch.randint(0, vocab, (rows, 20), generator=generator)
        if mode == "min-tokens":  # bans on top of the mask: a banned token stays banned
            banned = torch.randint(0, vocab, (rows, 5), generator=generator)
            batch.banned = (torch.arange(rows).repeat_interleave(5), banned.flatten())
        tokens = sampler(logits, batch).token_ids.tolist()
        for row, token in enumerate(tokens):
            assert is_allowed(bitmask, row, token), f"trial {trial}, row {row}: masked token {token} sampled"


def test_rows_outside_the_mask_and_logprobs_see_the_raw_logits() -> None:
    vocab = 200
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=generator)
    bitmask = random_bitmask(3, vocab, generator, allowed=2)
    batch = make_sampling_batch(3, temperature=torch.zeros(3), num_logprobs=torch.full((3,), 2), token_bitmask=bitmask,
                           bitmask_rows=[1])
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert is_allowed(bitmask, 1, int(out.token_ids[1]))
    raw = logits.log_softmax(-1)
    assert out.sampled_logprobs is not None and out.top_token_ids is not None
    assert torch.allclose(out.sampled_logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.equal(out.top_token_ids, raw.topk(2).indices)
