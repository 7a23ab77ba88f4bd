"""Continuous batching over the paged KV cache (after vLLM V1's scheduler).

Each step is one map {request: tokens to compute} under a token budget: running requests
first, then waiting ones; while any request decodes, prefill tokens (chunks of running prompts
and admissions alike) share a smaller cap, max_prefill_tokens_with_decodes (decode first).
Prefill, chunked prefill, prefix-cache hits and decode are one code path: `num_computed_tokens`
catching up with the request's tokens. With async scheduling the next plan is made before the
last result is back, so every scheduled step that will sample adds placeholder output tokens
(1 + its draft slots); results replace them. Stops known in advance (max_tokens, the context
length) count placeholders, so they never over-schedule; token-dependent stops are seen one
step late and the extra token is dropped.

KV blocks are held per KV cache group (kv_cache_manager.py): a request has one block table per
group, and a sliding-window group returns the blocks behind its window as the request advances.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from vmesh.services.common.step_types import NewRequest, StepPlan, StepResult
from vmesh.services.common.types import FinishReason, TokenLogprobs
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.kv_cache_manager import KVCacheManager
from vmesh.services.scheduler.request import Request, RequestStatus, adapter_fits
from vmesh.services.scheduler.settings import SchedulerConfig, SchedulerSettings, WorkerGeometry
from vmesh.services.scheduler.speculation import DraftPolicy, SpecDecodeStats, settle_step

# Compiled grammars travel inside the plan that admits their requests (up to 2 MiB each, the
# compiler's cap): a plan admits new constrained requests only while their payloads stay under
# this, a quarter of the internal links' message cap (grpc_server.MAX_MESSAGE_BYTES, 64 MiB); the
# rest wait a step. A plan's first new request is always admitted.
MAX_PLAN_GRAMMAR_BYTES = 16 << 20


class QueueFullError(RuntimeError): ...


@dataclass
class RequestUpdate:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    error: str = ""  # non-empty: the worker failed this request alone (finish_reason is ABORT)
    num_draft_tokens: int = 0  # speculation: this step's drafts for the request, and those it kept
    num_accepted_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with a request's first token, if it asked
    embedding: list[float] = field(default_factory=list)  # with an embedding request's first token


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
    num_preemptions: int
    num_scheduled_tokens: int  # every token computed so far, prompts included


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, eos_token_ids: tuple[int, ...] = (),
                 draft_policy: DraftPolicy | None = None, kv_cache_windows: tuple[int | None, ...] = (None,)):
        """`kv_cache_windows`: each KV cache group's sliding window (None: global), in the
        worker's group order; `pool` has a prefix cache for each."""
        self.config = config
        self.draft_policy = draft_policy or DraftPolicy()
        self.spec_stats = SpecDecodeStats()
        self.pool = pool
        self.kv = KVCacheManager(pool, kv_cache_windows)
        # A request may never need more KV than the whole pool, or preemption could not help it.
        # (A step computes at most the token budget, and drafts of this step and one in flight.)
        chunk = config.max_num_batched_tokens + 2 * self.draft_policy.num_speculative_tokens
        self.max_model_len = self.kv.max_context(config.max_model_len, chunk)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.by_handle: dict[int, Request] = {}
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []
        self.pending_removals: list[int] = []
        self.next_step = 0
        self._handles = itertools.count()
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0
        # Told of every request as it ends, whatever ended it (its shell keeps what a resumable one made).
        self.on_finished: Callable[[Request], None] = lambda request: None

    @classmethod
    def for_worker(cls, settings: SchedulerSettings, worker: WorkerGeometry,
                   hash_seed: int | None = None) -> Scheduler:
        """The scheduler for `worker`: its KV blocks, its limits and these settings. `hash_seed`:
        the prefix cache's (None: a random one per process; tests fix it)."""
        pool = BlockPool(worker.num_kv_blocks, worker.block_size, settings.enable_prefix_caching, hash_seed,
                         num_groups=len(worker.kv_cache_windows))
        # A stateless worker is resent whole requests with exact computed counts: it never speculates.
        drafts = 0 if settings.stateless_worker else worker.num_speculative_tokens
        return cls(SchedulerConfig.for_worker(settings, worker), pool, worker.eos_token_ids,
                   DraftPolicy(drafts, worker.speculative_disable_by_batch_size), worker.kv_cache_windows)

    # --- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(request.prompt_token_ids)} tokens leaves no room in the "
                             f"context of {self.max_model_len}")
        request.tables = self.kv.empty_tables()
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request wherever it is; False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def recompute_all(self) -> list[Request]:
        """The worker's state is gone (it died and a replacement took over): every unfinished
        request starts again from its tokens on the new worker, as a preempted one does, and the
        results of the plans in flight never come. The prefix cache goes too: its blocks' contents
        were on the lost worker. Returns the requests affected, in queue order."""
        for request in self.running:
            self.kv.free(request.tables)
            request.status = RequestStatus.WAITING
            self._enqueue(request)
        self.running = []
        for request in self.waiting:
            request.tables, request.block_hashes = self.kv.empty_tables(), []
            request.num_registered_blocks = request.num_computed_tokens = request.num_placeholders = 0
            request.draft_slots_in_flight.clear()
            request.on_worker = False
        self.pending_removals = []
        self.next_step = 0  # a new Execute stream numbers its steps from 0
        self.pool.reset_prefix_cache()
        return list(self.waiting)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no request is using; returns the number of blocks dropped."""
        return self.pool.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        pool = self.pool.stats()
        return SchedulerStats(len(self.running), len(self.waiting), pool.num_free, pool.num_blocks, pool.usage,
                              pool.prefix_queries, pool.prefix_hits, pool.evictions, self.num_preemptions,
                              self.num_scheduled_tokens)

    # --- planning ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute or remove (a plan that only
        removes rows is sent: an idle worker still learns promptly what finished)."""
        plan = StepPlan(step=self.next_step)
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        scheduled: set[int] = set()
        block_size = self.pool.block_size

        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or not self._can_produce(request):
                continue
            remaining = request.num_tokens_with_placeholders - request.num_computed_tokens
            n = min(remaining, budget) if remaining == 1 else min(remaining, budget, prefill_budget)
            if n == 0:  # a prefill chunk when this step's prefill budget is spent: next step
                continue
            drafts = self.draft_policy.slots(request, n, len(self.running), budget - n, self.max_model_len)
            # Drafts in flight may be rejected: only the tokens before them are surely computed.
            self.kv.free_behind_windows(request.tables,
                                        request.num_computed_tokens - sum(request.draft_slots_in_flight))
            entries = -(-(request.num_computed_tokens + n + drafts) // block_size)
            new_blocks = self.kv.allocate(request.tables, entries)
            while new_blocks is None:
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim)
                if victim is request:
                    break
                new_blocks = self.kv.allocate(request.tables, entries)
            if new_blocks is None:
                continue
            self._schedule(plan, request, n, new_blocks, drafts)
            scheduled.add(id(request))
            budget -= n + drafts
            prefill_budget -= n if remaining > 1 else 0

        grammar_bytes = 0
        for request in list(self.waiting):
            if min(budget, prefill_budget) == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.num_placeholders:  # preempted with a result still in flight
                continue
            grammar_bytes += len(request.sampling.grammar.payload) if request.sampling.grammar else 0
            if grammar_bytes > MAX_PLAN_GRAMMAR_BYTES and plan.new_requests:
                break
            if not (adapter_fits(self.running, request, self.config.max_loras)
                    and self._admit(plan, request, min(budget, prefill_budget))):
                break
            scheduled.add(id(request))
            budget -= plan.num_scheduled_tokens[-1]
            prefill_budget -= plan.num_scheduled_tokens[-1]

        if not plan.scheduled_handles and not self.pending_removals:
            return None
        plan.removed_handles, self.pending_removals = self.pending_removals, []
        self.next_step += 1
        return plan

    def _prefill_budget(self, budget: int) -> int:
        """Decode first: the prefill tokens this step may carry. Capped while any running request
        decodes in it (one token to compute), so that a long prompt delays the running streams by
        at most the cap's compute per step; the prompt still advances by the cap every step."""
        cap = self.config.max_prefill_tokens_with_decodes
        if cap and any(r.status is RequestStatus.RUNNING and self._can_produce(r)
                       and r.num_tokens_with_placeholders - r.num_computed_tokens == 1 for r in self.running):
            return min(cap, budget)
        return budget

    def _admit(self, plan: StepPlan, request: Request, budget: int) -> bool:
        block_size = self.pool.block_size
        tokens = request.all_token_ids
        # Never take the last token from the cache: its logits are needed.
        cacheable = (len(tokens) - 1) // block_size
        request.block_hashes = self.pool.hash_blocks(tokens[:cacheable * block_size], lora_name=request.lora_name)
        tables = self.kv.cached_prefix(tokens, request.reusable_block_hashes)
        computed = len(tables) * block_size
        n = min(len(tokens) - computed, budget)
        if self.kv.allocate(tables, -(-(computed + n) // block_size)) is None:
            self.kv.free(tables)
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.tables = tables
        request.num_registered_blocks = computed // block_size
        request.num_computed_tokens = computed
        if request.handle is None:  # first admission (not after a preemption or a lost worker)
            # A resumed request's outputs may be cached too: they are not prompt.
            request.num_cached_prompt_tokens = min(computed, len(request.prompt_token_ids))
            request.handle = next(self._handles)
            self.by_handle[request.handle] = request
        self.running.append(request)
        plan.new_requests.append(NewRequest(request.handle, tokens, len(request.prompt_token_ids),
                                            request.sampling, request.tables.flat(), computed, request.lora_name))
        request.on_worker = True
        self._schedule(plan, request, n)
        return True

    def _schedule(self, plan: StepPlan, request: Request, n: int, new_blocks: list[list[int]] | None = None,
                  drafts: int = 0) -> None:
        """`new_blocks`: those each group's table gained (none: no group's did). `drafts`: slots
        reserved for speculative tokens after the step's last (services/scheduler/speculation.py)."""
        assert request.handle is not None, "a scheduled request has a worker handle"
        plan.scheduled_handles.append(request.handle)
        plan.num_scheduled_tokens.append(n)
        plan.num_new_blocks.append(len(new_blocks[0]) if new_blocks else 0)
        for group_blocks in new_blocks or ():
            plan.new_block_ids += group_blocks
        if self.draft_policy.num_speculative_tokens:
            plan.num_draft_slots.append(drafts)
        request.num_computed_tokens += n
        self.num_scheduled_tokens += n
        if request.num_computed_tokens == request.num_tokens_with_placeholders:
            # This step samples the request's next token, and as many accepted drafts as it had
            # slots for at most: counted at that bound until the result says (update()).
            request.num_placeholders += 1 + drafts
            request.num_computed_tokens += drafts
            request.draft_slots_in_flight.append(drafts)
        self._register_full_blocks(request)

    def _can_produce(self, request: Request) -> bool:
        produced = len(request.output_token_ids) + request.num_placeholders
        return (produced < request.sampling.max_tokens
                and request.num_tokens_with_placeholders < self.max_model_len)

    def _register_full_blocks(self, request: Request) -> None:
        # Only blocks whose tokens are all known: a placeholder's block is never cached.
        block_size = self.pool.block_size
        full = min(request.num_computed_tokens, request.num_tokens) // block_size
        if full <= request.num_registered_blocks:
            return
        tokens = request.all_token_ids
        if len(request.block_hashes) < full:
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes += self.pool.hash_blocks(tokens[:full * block_size], parent, len(request.block_hashes),
                                                          request.lora_name)
        for i in range(request.num_registered_blocks, full):
            parent = request.block_hashes[i - 1] if i else None
            self.kv.register(request.tables, i, request.block_hashes[i], parent,
                             tokens[i * block_size:(i + 1) * block_size])
        request.num_registered_blocks = full

    def _pick_victim(self, exclude: set[int]) -> Request:
        candidates = [r for r in self.running if id(r) not in exclude]
        if self.config.policy == "priority":
            return max(candidates, key=self._queue_key)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute later: free every block, forget computed tokens, back to the queue front."""
        self.running.remove(request)
        self.kv.free(request.tables)
        request.tables, request.block_hashes = self.kv.empty_tables(), []
        request.num_registered_blocks = 0
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._leave_worker(request)
        self._enqueue(request)

    # --- results -----------------------------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestUpdate]:
        updates: dict[int, RequestUpdate] = {}
        counts = result.num_sampled_tokens or [1] * len(result.handles)
        drafted = result.num_draft_tokens or [0] * len(result.handles)
        offset = 0
        for handle, count, num_drafts in zip(result.handles, counts, drafted):
            tokens = result.sampled_token_ids[offset:offset + count]
            offset += count
            request = self.by_handle.get(handle)
            if request is None:
                continue  # sampled after the request had already stopped: dropped
            settle_step(request, count, num_drafts, self.spec_stats)
            update = updates[handle] = RequestUpdate(request.request_id, [], None, [], request.num_cached_prompt_tokens,
                                                     num_draft_tokens=num_drafts, num_accepted_tokens=count - 1,
                                                     prompt_logprobs=result.prompt_logprobs.get(handle, []),
                                                     embedding=result.embeddings.get(handle, []))
            for token in tokens:  # those after a stop are dropped
                request.output_token_ids.append(token)
                update.new_token_ids.append(token)
                update.finish_reason = self._stop_reason(request, token)
                if update.finish_reason is not None:
                    self._finish(request, update.finish_reason)
                    break
        for handle, row in zip(result.logprobs_handles, result.logprobs):
            owner = updates.get(handle)
            if owner is not None and len(owner.logprobs) < len(owner.new_token_ids):
                owner.logprobs.append(row)
        for handle, message in zip(result.failed_handles, result.failure_messages):
            request = self.by_handle.get(handle)
            if request is not None and not request.is_finished:
                updates[handle] = RequestUpdate(request.request_id, [], FinishReason.ABORT, error=message,
                                                num_cached_prompt_tokens=request.num_cached_prompt_tokens)
                self._finish(request, FinishReason.ABORT)
        return list(updates.values())

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling
        num_output = len(request.output_token_ids)
        if params.grammar is not None and token in self.eos_token_ids:
            return FinishReason.STOP  # the worker allows EOS only where the grammar is complete: it ended
        stop_token = (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        if stop_token and num_output >= params.min_tokens:
            return FinishReason.STOP
        if num_output >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._register_full_blocks(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request.tables)
        request.tables = self.kv.empty_tables()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._leave_worker(request)
        del self.requests[request.request_id]
        if request.handle is not None:
            del self.by_handle[request.handle]
        self.on_finished(request)

    def _leave_worker(self, request: Request) -> None:
        if request.on_worker:
            assert request.handle is not None, "a request on the worker has a handle"
            self.pending_removals.append(request.handle)
            request.on_worker = False

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._queue_key)

    def _queue_key(self, request: Request) -> tuple[int, int]:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_order)
        return (0, request.arrival_order)
