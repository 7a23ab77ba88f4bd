"""The worker's persistent batch: one row per running request, changed only by step diffs.

Rows live in fixed preallocated tensors (token ids, computed-token counts, one block table per
KV cache group, sampling parameters). A plan removes rows (the last row moves into the hole, so rows stay
dense), adds rows for new requests, appends block ids, and names the tokens to compute.
The step's input tensors are gathered from the rows in the plan's order, so they depend
only on the requests' states, never on where their rows happen to sit. A row whose request
carries a grammar holds its matcher (services/worker/grammar_rows.py), which moves with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import FLOAT_SAMPLING_FIELDS, SamplingParams
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.speculative.proposers import propose
from vmesh.services.speculative.recent_outputs import RecentOutputs
from vmesh.services.speculative.verification import num_accepted
from vmesh.services.worker.attention import AttentionMetadata
from vmesh.services.worker.grammar_rows import GrammarTokenizer, RowGrammar, row_grammar
from vmesh.services.worker.sampler import NO_LOGPROBS


class PlanError(ValueError):
    """A plan that does not fit the batch's state (unknown handle, duplicate, overflow)."""


@dataclass
class StepInputs:
    rows: torch.Tensor  # [num_reqs] row of each scheduled request, in plan order
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_logits] each request's last scheduled token, and its drafts'
    attention: list[AttentionMetadata]  # one per KV cache group: its block tables and slots
    num_scheduled: torch.Tensor  # [num_reqs] tokens computed before any drafts
    # Speculation: each request computes its drafts after its scheduled tokens and samples at
    # 1 + num_drafts positions; logits row i belongs to request logits_request[i], samples at
    # row sample_rows[i] with sample_lengths[i] tokens before it. Without drafts: one per request.
    num_drafts: torch.Tensor  # [num_reqs]
    logits_request: torch.Tensor  # [num_logits]
    sample_rows: torch.Tensor  # [num_logits]
    sample_lengths: torch.Tensor  # [num_logits]
    sample_offsets: torch.Tensor  # [num_logits] 0 for the request's next token, j for the one after draft j
    num_accepted: torch.Tensor | None = None  # [num_reqs] drafts each request kept, set by finish_step


# Sampling parameters kept as columns, and the SamplingParams attribute each one mirrors.
class PersistentBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device,
                 num_kv_blocks: int | None = None, grammar_tokenizer: GrammarTokenizer | None = None,
                 num_kv_groups: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        # The pool's size: the C kernels write and read blocks by id without bounds checks, so a
        # plan naming a block outside the pool is refused here rather than corrupting memory.
        self.num_kv_blocks = num_kv_blocks
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int64)
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_prompt_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        # [row, KV cache group, entry]: a plan's block ids carry each group's entries in turn.
        self.num_kv_groups = num_kv_groups
        self.block_table = torch.zeros((max_num_reqs, num_kv_groups, max_blocks), dtype=torch.int64)
        self.num_blocks = torch.zeros(max_num_reqs, dtype=torch.int64)
        # numpy views sharing the tensors' memory, for the per-step index arithmetic.
        self._token_ids_np, self._num_tokens_np = self.token_ids.numpy(), self.num_tokens.numpy()
        self._num_computed_np, self._num_blocks_np = self.num_computed_tokens.numpy(), self.num_blocks.numpy()
        self._block_table_np = self.block_table.numpy()
        self.float_params = {name: torch.zeros(max_num_reqs, dtype=torch.float32) for name in FLOAT_SAMPLING_FIELDS}
        self.top_k = torch.full((max_num_reqs,), -1, dtype=torch.int64)
        self.min_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_logprobs = torch.full((max_num_reqs,), NO_LOGPROBS, dtype=torch.int64)
        # Each row's LoRA adapter (services/worker/lora.py sets it; 0: the base model).
        self.adapter_ids = torch.zeros(max_num_reqs, dtype=torch.int64)
        self._sampling_np = {name: column.numpy() for name, column in (
            *self.float_params.items(), ("top_k", self.top_k), ("num_logprobs", self.num_logprobs),
            ("min_tokens", self.min_tokens), ("num_prompt_tokens", self.num_prompt_tokens))}
        self.seeds: list[int | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.sampling: list[SamplingParams | None] = [None] * max_num_reqs
        self.grammar_tokenizer = grammar_tokenizer
        self.grammars: list[RowGrammar | None] = [None] * max_num_reqs
        self.num_grammars = 0  # rows holding a grammar: none, and a step costs nothing for them
        # Matchers of rows removed with keep_grammar (the stateless worker's rebuild), by handle,
        # taken back by the handle's next add and dropped after the plan's adds.
        self.spare_grammars: dict[int, RowGrammar] = {}
        self.handle_of_row: list[int] = []
        self.row_of_handle: dict[int, int] = {}
        # The suffix method's cache of recent outputs (keep_recent_outputs): the outputs of requests
        # the plans remove (finished, aborted or preempted) go in.
        self.recent_outputs: RecentOutputs | None = None

    def __len__(self) -> int:
        return len(self.handle_of_row)

    def __contains__(self, handle: int) -> bool:
        return handle in self.row_of_handle

    # --- diffs -----------------------------------------------------------------------------

    def apply(self, plan: StepPlan) -> None:
        for handle in plan.removed_handles:
            if self.recent_outputs is not None and (row := self.row_of_handle.get(handle)) is not None:
                self.recent_outputs.add(handle, self._token_ids_np[row, self._sampling_np["num_prompt_tokens"][row]:
                                                                   self._num_tokens_np[row]])
            self.remove(handle)
        for request in plan.new_requests:
            self.add(request)
        self.spare_grammars.clear()
        if len(plan.num_scheduled_tokens) != len(plan.scheduled_handles) or (
            plan.num_new_blocks and len(plan.num_new_blocks) != len(plan.scheduled_handles)
        ):
            raise PlanError("scheduled columns have different lengths")
        if plan.new_block_ids:
            offset = 0
            for handle, count in zip(plan.scheduled_handles, plan.num_new_blocks):
                if count:  # that many entries in each group's table, group after group
                    ids = count * self.num_kv_groups
                    self.append_blocks(handle, plan.new_block_ids[offset:offset + ids])
                    offset += ids
            if offset != len(plan.new_block_ids):
                raise PlanError("new_block_ids does not match num_new_blocks")

    def add(self, request: NewRequest) -> None:
        if request.handle in self.row_of_handle:
            raise PlanError(f"request handle {request.handle} is already in the batch")
        if len(self) == self.max_num_reqs:
            raise PlanError(f"the batch is full ({self.max_num_reqs} requests)")
        n = len(request.token_ids)
        if not 0 < n <= self.max_model_len:
            raise PlanError(f"request {request.handle} has {n} tokens (max {self.max_model_len})")
        if not 0 <= request.num_computed_tokens < n:
            raise PlanError(f"request {request.handle}: num_computed_tokens {request.num_computed_tokens} "
                            f"outside [0, {n})")
        row = len(self)
        self.handle_of_row.append(request.handle)
        self.row_of_handle[request.handle] = row
        self.token_ids[row, :n] = torch.tensor(request.token_ids, dtype=torch.int64)
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.num_computed_tokens[row] = request.num_computed_tokens
        # Entries past a row's blocks stay zero, so step inputs never show a former occupant's.
        self.block_table[row] = 0
        self.num_blocks[row] = 0
        self._write_blocks(row, request.block_ids)
        params = request.sampling
        for name, column in self.float_params.items():
            column[row] = getattr(params, name)
        self.top_k[row] = params.top_k
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        self.adapter_ids[row] = 0
        self.seeds[row] = params.seed
        # On the logits' device: a CPU generator cannot fill a CUDA tensor (a seeded row draws its
        # uniform in place), so a seeded stream is reproducible per device kind.
        self.generators[row] = torch.Generator(device=self.device) if params.seed is not None else None
        self.sampling[row] = params
        grammar = self.spare_grammars.pop(request.handle, None) or row_grammar(params, self.grammar_tokenizer)
        if grammar is not None:
            grammar.sync(request.token_ids[request.num_prompt_tokens:])  # the outputs it must have seen
            self.num_grammars += 1
        self.grammars[row] = grammar

    def append_blocks(self, handle: int, block_ids: list[int]) -> None:
        self._write_blocks(self._row(handle), block_ids)

    def remove(self, handle: int, keep_grammar: bool = False) -> None:
        """keep_grammar: the row's matcher waits in spare_grammars for the handle's next add."""
        row = self.row_of_handle.pop(handle, None)
        if row is None:
            raise PlanError(f"cannot remove unknown request handle {handle}")
        grammar = self.grammars[row]
        if grammar is not None:
            self.num_grammars -= 1
            if keep_grammar:
                self.spare_grammars[handle] = grammar
        last = len(self.handle_of_row) - 1
        if row != last:
            self._move_row(last, row)
            moved = self.handle_of_row[last]
            self.handle_of_row[row] = moved
            self.row_of_handle[moved] = row
        self.handle_of_row.pop()
        self.seeds[last] = self.generators[last] = self.sampling[last] = self.grammars[last] = None

    def _row(self, handle: int) -> int:
        row = self.row_of_handle.get(handle)
        if row is None:
            raise PlanError(f"unknown request handle {handle}")
        return row

    def _write_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append `block_ids`: the same number of entries to each group's table, group after group."""
        count, rest = divmod(len(block_ids), self.num_kv_groups)
        if rest:
            raise PlanError(f"{len(block_ids)} block ids do not split into {self.num_kv_groups} KV cache groups")
        start = int(self.num_blocks[row])
        end = start + count
        if end > self.block_table.shape[2]:
            raise PlanError(f"block table of row {row} overflows ({end} > {self.block_table.shape[2]})")
        limit = self.num_kv_blocks
        if block_ids and limit is not None and not 0 <= min(block_ids) <= max(block_ids) < limit:
            raise PlanError(f"block ids {min(block_ids)}..{max(block_ids)} fall outside the worker's "
                            f"{self.num_kv_blocks} KV blocks")
        self.block_table[row, :, start:end] = torch.tensor(block_ids, dtype=torch.int64).view(self.num_kv_groups, count)
        self.num_blocks[row] = end

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.block_table[dst] = self.block_table[src]
        for column in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
                       self.top_k, self.min_tokens, self.num_logprobs, self.adapter_ids, *self.float_params.values()):
            column[dst] = column[src]
        self.seeds[dst], self.generators[dst], self.sampling[dst], self.grammars[dst] = (
            self.seeds[src], self.generators[src], self.sampling[src], self.grammars[src])

    # --- per-step inputs -------------------------------------------------------------------

    def prepare_inputs(self, plan: StepPlan, speculative: SpeculativeConfig | None = None) -> StepInputs:
        """`speculative`: the worker's proposer, for the rows the plan reserved draft slots for.
        The index arithmetic runs on numpy views of the batch's tensors: at a few rows a step is
        dozens of tiny ops, and numpy's cost per op is a fraction of torch's."""
        rows = np.array([self._row(h) for h in plan.scheduled_handles], dtype=np.int64)
        num_scheduled = np.array(plan.num_scheduled_tokens, dtype=np.int64)
        start, known = self._num_computed_np[rows], self._num_tokens_np[rows]
        if (bad := np.flatnonzero((num_scheduled < 1) | (start + num_scheduled > known))).size:
            i = int(bad[0])
            raise PlanError(f"request {plan.scheduled_handles[i]}: cannot compute "
                            f"{plan.num_scheduled_tokens[i]} tokens after {int(start[i])} of {int(known[i])} known")
        num_drafts = (self._propose_drafts(plan, torch.from_numpy(rows), torch.from_numpy(num_scheduled),
                                           speculative).numpy()
                      if plan.num_draft_slots and speculative is not None else np.zeros(len(rows), dtype=np.int64))
        num_scheduled_with_drafts = num_scheduled + num_drafts
        seq_lens = start + num_scheduled_with_drafts
        capacity = self._num_blocks_np[rows] * self.block_size
        if (bad := np.flatnonzero(seq_lens > capacity)).size:
            i = int(bad[0])
            raise PlanError(f"request {plan.scheduled_handles[i]}: {int(seq_lens[i])} tokens do not fit "
                            f"its {int(capacity[i]) // self.block_size} blocks")
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled_with_drafts, out=query_start[1:])
        request_of_token = np.repeat(np.arange(len(rows)), num_scheduled_with_drafts)
        row_of_token = rows[request_of_token]
        positions = np.arange(int(query_start[-1])) - query_start[request_of_token] + start[request_of_token]
        input_ids = self._token_ids_np[row_of_token, positions]
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        query_start_device = self._on_device(query_start.astype(np.int32))
        seq_lens_device = self._on_device(seq_lens.astype(np.int32))
        query_lens_cpu, seq_lens_cpu = num_scheduled_with_drafts.tolist(), seq_lens.tolist()
        entries, offsets = np.divmod(positions, self.block_size)
        metas = []
        for group in range(self.num_kv_groups):
            slots = self._block_table_np[row_of_token, group, entries] * self.block_size + offsets
            metas.append(AttentionMetadata(
                slot_mapping=self._on_device(slots), query_start_loc=query_start_device, seq_lens=seq_lens_device,
                block_tables=self._on_device(self._block_table_np[rows, group, :max_blocks].astype(np.int32)),
                query_lens_cpu=query_lens_cpu, seq_lens_cpu=seq_lens_cpu))
        samples = num_drafts + 1
        logits_request = np.repeat(np.arange(len(rows)), samples)
        first_sample = np.cumsum(samples) - samples
        offset = np.arange(len(logits_request)) - first_sample[logits_request]  # 0: the row's next token
        logits_indices = query_start[logits_request + 1] - samples[logits_request] + offset
        sample_rows = rows[logits_request]
        return StepInputs(
            rows=torch.from_numpy(rows),
            input_ids=self._on_device(input_ids),
            positions=self._on_device(positions),
            logits_indices=self._on_device(logits_indices),
            attention=metas,
            num_scheduled=torch.from_numpy(num_scheduled),
            num_drafts=torch.from_numpy(num_drafts),
            logits_request=torch.from_numpy(logits_request),
            sample_rows=torch.from_numpy(sample_rows),
            sample_lengths=torch.from_numpy(self._num_tokens_np[sample_rows] + offset),
            sample_offsets=torch.from_numpy(offset),
        )

    def sampling_columns(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the sampling columns at `rows`: one per FLOAT_SAMPLING_FIELDS name, top_k,
        num_logprobs, min_tokens and num_prompt_tokens."""
        return {name: column[rows] for name, column in self._sampling_np.items()}

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def _propose_drafts(self, plan: StepPlan, rows: torch.Tensor, num_scheduled: torch.Tensor,
                        speculative: SpeculativeConfig | None) -> torch.Tensor:
        """[num_reqs] drafts proposed for each request and written after its known tokens (in
        token_ids, past num_tokens): only rows that decode (their one scheduled token is their
        last known one) in slots the plan reserved, never for a grammar's row."""
        num_drafts = torch.zeros(len(rows), dtype=torch.int64)
        if not plan.num_draft_slots or speculative is None:
            return num_drafts
        if len(plan.num_draft_slots) != len(plan.scheduled_handles):
            raise PlanError("num_draft_slots does not match scheduled_handles")
        slots = torch.tensor(plan.num_draft_slots, dtype=torch.int64)
        lengths = self.num_tokens[rows]
        decoding = (num_scheduled == 1) & (self.num_computed_tokens[rows] + 1 == lengths) & (slots > 0)
        if self.num_grammars:
            decoding &= torch.tensor([g is None for g in (self.grammars[r] for r in rows.tolist())])
        # The row's last sample lands at lengths + slots.
        if bool(((slots > 0) & (lengths + slots >= self.max_model_len)).any()):
            raise PlanError("draft slots reach past max_model_len")
        chosen = torch.nonzero(decoding).squeeze(1)
        if not len(chosen):
            return num_drafts
        chosen_rows, chosen_lengths = rows[chosen], lengths[chosen]
        tokens = self.token_ids[chosen_rows, :int(chosen_lengths.max())]
        drafts, counts = propose(speculative, tokens, chosen_lengths, slots[chosen], self.recent_outputs)
        # Each draft goes where its position lies; columns past a row's count are written back unchanged.
        column = (chosen_lengths[:, None] + torch.arange(drafts.shape[1])[None, :]).clamp(max=self.max_model_len - 1)
        keep = torch.arange(drafts.shape[1])[None, :] < counts[:, None]
        current = self.token_ids[chosen_rows[:, None], column]
        self.token_ids[chosen_rows[:, None], column] = torch.where(keep, drafts, current)
        num_drafts[chosen] = counts
        return num_drafts

    def keep_recent_outputs(self, speculative: SpeculativeConfig | None) -> None:
        """Keep a cache of recent outputs as `speculative` asks (before a plan's removals are
        applied, so that none is missed), or none."""
        wanted = speculative.suffix_decoding_max_cached_requests if speculative is not None else 0
        if not wanted:
            self.recent_outputs = None
        elif self.recent_outputs is None or self.recent_outputs.max_requests != wanted:
            self.recent_outputs = RecentOutputs(wanted)

    def finish_step(self, inputs: StepInputs, sampled: torch.Tensor) -> torch.Tensor:
        """Advance computed counts and append each request's sampled tokens when its step
        reached the end of its known tokens: its next token, preceded by the drafts it accepted
        (services/speculative/verification.py). `sampled`: one token per logits row, on the CPU.
        Returns the mask of requests that produced tokens; how many drafts each accepted goes in
        inputs.num_accepted. numpy views, as prepare_inputs."""
        rows, num_scheduled, num_drafts = inputs.rows.numpy(), inputs.num_scheduled.numpy(), inputs.num_drafts.numpy()
        produced = self._num_computed_np[rows] + num_scheduled == self._num_tokens_np[rows]
        width = int(num_drafts.max()) if len(rows) else 0
        samples = np.full((len(rows), width + 1), -1, dtype=np.int64)
        samples[inputs.logits_request.numpy(), inputs.sample_offsets.numpy()] = sampled.numpy()
        accepted = np.zeros(len(rows), dtype=np.int64)
        if width:
            columns = np.minimum(self._num_tokens_np[rows][:, None] + np.arange(width)[None, :], self.max_model_len - 1)
            drafts = torch.from_numpy(self._token_ids_np[rows[:, None], columns])
            accepted = num_accepted(torch.from_numpy(samples), drafts, inputs.num_drafts).numpy()
        self._num_computed_np[rows] += num_scheduled + accepted
        out = np.flatnonzero(produced)
        out_rows, kept = rows[out], accepted[out] + 1
        lengths = self._num_tokens_np[out_rows]
        if (lengths + kept > self.max_model_len).any():
            raise PlanError("a request would grow past max_model_len")
        # Every sample of a produced row is written; those past its kept ones lie beyond num_tokens (unread).
        keep = np.arange(width + 1)[None, :] < (num_drafts[out] + 1)[:, None]
        write_rows = np.broadcast_to(out_rows[:, None], keep.shape)[keep]
        write_columns = (lengths[:, None] + np.arange(width + 1)[None, :])[keep]
        self._token_ids_np[write_rows, write_columns] = samples[out][keep]
        self._num_tokens_np[out_rows] += kept
        inputs.num_accepted = torch.from_numpy(accepted)
        return torch.from_numpy(produced)
