"""A worker stand-in for scheduler tests: it applies plans exactly as the real persistent
batch does (rows, computed counts, its own sampled tokens) but "samples" a token that is a
pure function of the request's token sequence, so correct scheduling gives the same tokens
whatever the batching, preemption or pipeline depth."""

from __future__ import annotations

from vmesh.services.common.step_types import StepPlan, StepResult


def next_token(tokens: list[int], vocab: int = 97) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-8:])) + len(tokens)) % vocab


class StubWorker:
    def __init__(self, num_blocks: int, block_size: int, eos_after: dict[int, int] | None = None):
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.last_step = -1
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step == self.last_step + 1, "plans must arrive in order without gaps"
        self.last_step = plan.step
        self.plans.append(plan)
        for h in plan.removed_handles:
            del self.tokens[h], self.computed[h], self.blocks[h]
        for r in plan.new_requests:
            assert r.handle not in self.tokens
            self.tokens[r.handle] = list(r.token_ids)
            self.computed[r.handle] = r.num_computed_tokens
            self.blocks[r.handle] = list(r.block_ids)
        offset = 0
        handles, sampled = [], []
        for h, n, nb in zip(plan.scheduled_handles, plan.num_scheduled_tokens,
                            plan.num_new_blocks or [0] * len(plan.scheduled_handles)):
            self.blocks[h] += plan.new_block_ids[offset:offset + nb]
            offset += nb
            assert n >= 1
            self.computed[h] += n
            assert self.computed[h] <= len(self.tokens[h]), "scheduled past the known tokens"
            assert len(self.blocks[h]) * self.block_size >= self.computed[h], "KV slots missing"
            assert all(0 <= b < self.num_blocks for b in self.blocks[h])
            if self.computed[h] == len(self.tokens[h]):
                token = next_token(self.tokens[h])
                self.tokens[h].append(token)
                handles.append(h)
                sampled.append(token)
        return StepResult(plan.step, handles, sampled)


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
