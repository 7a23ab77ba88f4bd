"""The scheduler's side of speculative decoding: how many draft slots a decode reserves, and
the acceptance counters (vLLM's spec_decode metrics).

A decode row that may speculate is scheduled for 1 + k tokens of KV: its next token and up to
k drafts the worker proposes (services/speculative/). Until the step's result is back the
scheduler counts its upper bound, 1 + k placeholders and k more computed tokens; the result
says how many of the k were kept (`Scheduler.update` corrects both counts), and the slots of
the rejected ones are the row's next slots: blocks stay with the request, nothing leaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vmesh.services.scheduler.request import Request, RequestStatus


@dataclass
class SpecDecodeStats:
    """Counters under vLLM's names: steps in which a row had drafts, the drafts, those accepted,
    and accepted by position (a draft at position j is accepted only after every one before it)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if not num_draft_tokens:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


# A request whose recent drafts were accepted less often than this stops speculating, but for
# one probing step in PROBE_EVERY decodes (its text may start repeating its prompt later).
MIN_ACCEPTANCE = 0.2
PROBE_EVERY = 8
ACCEPTANCE_DECAY = 0.7  # weight of the past in the running acceptance rate


@dataclass(frozen=True)
class DraftPolicy:
    """Where speculation is turned off: for requests with a grammar (the worker's matcher would
    have to verify every draft), in steps with `disable_by_batch_size` running requests or more
    (a large batch is bound by arithmetic, so verifying rejected drafts costs more than it saves),
    for a request whose drafts keep being rejected (MIN_ACCEPTANCE, probing now and then), and
    near each request's max_tokens and the context length (never a token past them)."""
    num_speculative_tokens: int = 0  # 0: off
    disable_by_batch_size: int = 0  # 0: no batch-size limit

    def slots(self, request: Request, num_scheduled: int, num_running: int, budget_left: int,
              max_model_len: int) -> int:
        """Draft slots for a request scheduled for `num_scheduled` tokens: none unless it decodes (its
        one token is its last known one; the worker proposes only there); `budget_left`: tokens of
        the step's budget after that one."""
        k = self.num_speculative_tokens
        decodes = num_scheduled == 1 and request.num_computed_tokens + 1 == request.num_tokens_with_placeholders
        if not k or not decodes or request.sampling.grammar is not None or request.sampling.structured is not None:
            return 0
        if self.disable_by_batch_size and num_running >= self.disable_by_batch_size:
            return 0
        if request.draft_acceptance < MIN_ACCEPTANCE:
            request.decodes_without_drafts += 1
            if request.decodes_without_drafts % PROBE_EVERY:
                return 0
        produced = len(request.output_token_ids) + request.num_placeholders
        # This step keeps at most 1 + k tokens; the worker writes its last sample at num_tokens + k.
        room = min(request.sampling.max_tokens - produced - 1, max_model_len - request.num_tokens_with_placeholders - 1)
        return max(0, min(k, room, budget_left))


def settle_step(request: Request, num_kept: int, num_draft_tokens: int, stats: SpecDecodeStats) -> None:
    """The oldest step in flight for `request` proposed `num_draft_tokens` drafts and kept
    `num_kept` tokens (1 + accepted) of the 1 + slots it was counted at: the rejected drafts'
    slots are free for the request's next tokens, and the acceptance counts move."""
    num_accepted = num_kept - 1
    stats.record(num_draft_tokens, num_accepted)
    if num_draft_tokens:
        rate = num_accepted / num_draft_tokens
        request.draft_acceptance = ACCEPTANCE_DECAY * request.draft_acceptance + (1 - ACCEPTANCE_DECAY) * rate
    slots = request.draft_slots_in_flight.popleft() if request.draft_slots_in_flight else 0
    request.num_placeholders -= 1 + slots
    if request.status is RequestStatus.RUNNING:  # a preempted request computes from 0 again
        request.num_computed_tokens -= slots - num_accepted
