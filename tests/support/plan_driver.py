"""A deliberately simple driver that feeds hand-built step plans to a ModelRunner, so the
worker core is tested without the scheduler: blocks come from a counter, each request
computes at most `chunk` prompt tokens per step, and requests join at given steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.model_runner import ModelRunner


@dataclass
class DrivenRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    join_step: int = 0
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    handle: int = -1
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # one table per KV cache group
    output: list[int] = field(default_factory=list)
    logprob_results: list[tuple[float, int, list[int], list[float]]] = field(default_factory=list)
    sent: bool = False

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


def drive(runner: ModelRunner, requests: list[DrivenRequest], chunk: int = 1 << 30, step_offset: int = 0) -> None:
    block_size, groups = runner.kv_cache.block_size, runner.kv_cache.num_groups
    next_block = 0
    for i, r in enumerate(requests):
        r.handle = i
        r.blocks = [[] for _ in range(groups)]
    step = step_offset
    while not all(r.done for r in requests):
        plan = StepPlan(step=step)
        for r in requests:
            if r.done or step - step_offset < r.join_step:
                continue
            n = min(chunk, r.num_tokens - r.computed)
            need = -(-(r.computed + n) // block_size) - len(r.blocks[0])
            new_blocks = list(range(next_block, next_block + need * groups))  # each group's in turn
            next_block += need * groups
            for g, table in enumerate(r.blocks):
                table += new_blocks[g * need:(g + 1) * need]
            if not r.sent:
                plan.new_requests.append(NewRequest(r.handle, list(r.prompt), len(r.prompt), r.sampling,
                                                    [b for table in r.blocks for b in table], lora_name=r.lora_name))
                r.sent = True
                need, new_blocks = 0, []
            plan.scheduled_handles.append(r.handle)
            plan.num_scheduled_tokens.append(n)
            plan.num_new_blocks.append(need)
            plan.new_block_ids += new_blocks
            r.computed += n
        assert next_block <= runner.kv_cache.num_blocks, "test KV pool too small"
        result = runner.execute(plan)
        by_handle = dict(zip(result.handles, result.sampled_token_ids))
        for h, row in zip(result.logprobs_handles, result.logprobs):
            requests[h].logprob_results.append((row.logprob, row.rank, row.top_token_ids, row.top_logprobs))
        finished = []
        for h, token in by_handle.items():
            requests[h].output.append(token)
            if requests[h].done:
                finished.append(h)
        if finished:
            step += 1
            runner.execute(StepPlan(step=step, removed_handles=finished))
        step += 1


def greedy_ragged(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs over ragged steps: decodes beside prefill chunks of 16, chunks after cached context."""
    requests = [DrivenRequest(p, max_tokens, join_step=i % 3) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=16)
    return [r.output for r in requests]


def forced_agreement(runner: ModelRunner, prompts: list[list[int]], want: list[list[int]]) -> float:
    """The share of `want`'s tokens that `runner` picks greedily given every prefix before it
    (teacher forcing): each prefix one request for one token."""
    forced = [(p + out[:k], out[k]) for p, out in zip(prompts, want) for k in range(len(out))]
    got = [out[0] for out in greedy_ragged(runner, [f for f, _ in forced], 1)]
    return sum(g == token for g, (_, token) in zip(got, forced)) / len(forced)
