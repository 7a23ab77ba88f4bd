"""A worker stand-in for scheduler tests: it applies plans exactly as the real persistent
batch does (rows, computed counts, its own sampled tokens) but "samples" a token that is a
pure function of the request's token sequence, so correct scheduling gives the same tokens
whatever the batching, preemption or pipeline depth.

It keeps a KV memory too: each step writes every computed token's id into its slot of each KV
cache group's table (`windows`, one per group, None: global), and reads back every position the
step's queries see through the group's window, which must hold the request's own tokens. A
block freed while still visible and handed to another request, or a wrong prefix-cache hit,
shows up as a foreign token there."""

from __future__ import annotations

from vmesh.services.common.step_types import StepPlan, StepResult


def next_token(tokens: list[int], vocab: int = 97) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-8:])) + len(tokens)) % vocab


class StubWorker:
    def __init__(self, num_blocks: int, block_size: int, eos_after: dict[int, int] | None = None,
                 windows: tuple[int | None, ...] = (None,)):
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.blocks: dict[int, list[list[int]]] = {}  # per handle, one table per group
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.memory: dict[tuple[int, int], int] = {}  # (block, slot) -> token id
        self.positions_checked = 0
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
            self.blocks[r.handle] = self._split(list(r.block_ids))
        offset = 0
        handles, sampled = [], []
        groups = len(self.windows)
        for h, n, nb in zip(plan.scheduled_handles, plan.num_scheduled_tokens,
                            plan.num_new_blocks or [0] * len(plan.scheduled_handles)):
            for table, added in zip(self.blocks[h], self._split(plan.new_block_ids[offset:offset + nb * groups])):
                table += added
            offset += nb * groups
            assert n >= 1
            start = self.computed[h]
            self.computed[h] += n
            assert self.computed[h] <= len(self.tokens[h]), "scheduled past the known tokens"
            assert len(self.blocks[h][0]) * self.block_size >= self.computed[h], "KV slots missing"
            assert all(0 <= b < self.num_blocks for table in self.blocks[h] for b in table)
            self._write_and_check(h, start, self.computed[h])
            if self.computed[h] == len(self.tokens[h]):
                token = next_token(self.tokens[h])
                self.tokens[h].append(token)
                handles.append(h)
                sampled.append(token)
        return StepResult(plan.step, handles, sampled)

    def _split(self, ids: list[int]) -> list[list[int]]:
        per_group = len(ids) // len(self.windows)
        assert per_group * len(self.windows) == len(ids), "block ids are not one table per group"
        return [ids[g * per_group:(g + 1) * per_group] for g in range(len(self.windows))]

    def _write_and_check(self, handle: int, start: int, end: int) -> None:
        tokens, bs = self.tokens[handle], self.block_size
        for table in self.blocks[handle]:
            for position in range(start, end):
                self.memory[table[position // bs], position % bs] = tokens[position]
        for table, window in zip(self.blocks[handle], self.windows):
            first = 0 if window is None else max(0, start - window + 1)  # the step's first query's window
            for position in range(first, end):
                seen = self.memory.get((table[position // bs], position % bs))
                assert seen == tokens[position], (f"request {handle} reads token {seen} at position {position} "
                                                  f"(window {window}), not its own {tokens[position]}")
            self.positions_checked += end - first


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
