"""One worker step: apply the plan's diff, build inputs, run the model, sample."""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from vmesh.kernels.cpu_native import CpuKernelBuildError, CpuKernels, load_cpu_kernels
from vmesh.services.common.model_loading import (
    ModelLoadError,
    cache_dir_path,
    load_model_spec,
    load_state_dict,
    resolve_model_dir,
)
from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.common.types import FLOAT_SAMPLING_FIELDS, TokenLogprobs
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.attention import AttentionBackend, CpuAttentionBackend, make_attention_backend
from vmesh.services.worker.config import DTYPE_NAMES, WorkerConfig
from vmesh.services.worker.grammar_rows import GrammarMask, GrammarTokenizer, RowGrammar
from vmesh.services.worker.int8_linear import int8_kernels
from vmesh.services.worker.kv_cache import KVCache, kv_cache_budget, kv_cache_dtype
from vmesh.services.worker.lora import LoraManager
from vmesh.services.worker.model import DecoderModel, MissingWeightError
from vmesh.services.worker.persistent_batch import PersistentBatch, PlanError, StepInputs
from vmesh.services.worker.pooling import PooledPositions, Pooler
from vmesh.services.worker.prompt_logprobs import PromptLogprobs, ScoredPositions
from vmesh.services.worker.quantized_linear import load_native_weights
from vmesh.services.worker.sampler import Sampler, SamplerOutput, SamplingBatch
from vmesh.services.worker.tensor_parallel import join_group, shard_spec, shard_weights

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def release_freed_heap() -> None:
    """Hand the heap pages freed while loading (each weight's float32 copy, once packed) back to
    the system: glibc keeps them otherwise, ~20 MiB of the worker's PSS. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already has loaded
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, backend: AttentionBackend,
                 max_num_seqs: int, max_model_len: int, grammar_tokenizer: GrammarTokenizer | None = None,
                 speculative: SpeculativeConfig | None = None, cpu_kernels: CpuKernels | None = None):
        self.model = model
        self.speculative = speculative  # proposes drafts where a plan reserves slots for them
        self.kv_cache = kv_cache
        self.backend = backend
        self.max_model_len = max_model_len
        self.batch = PersistentBatch(max_num_seqs, max_model_len, kv_cache.block_size, model.device,
                                     kv_cache.num_blocks, grammar_tokenizer, kv_cache.num_groups)
        self.sampler = Sampler(cpu_kernels)
        self.prompt_logprobs = PromptLogprobs()  # the rows asking for them, until their first token
        self.pooler = Pooler()  # the embedding requests' rows, until their first token
        self.last_step = -1
        self.grammar_mask = GrammarMask(model.spec.vocab_size)
        # Fills the grammar rows' token bitmask while the model computes (both backends release
        # the GIL); started on the first step that has a grammar.
        self.overlap_grammar_fill = True
        self._mask_thread: ThreadPoolExecutor | None = None
        self.lora: LoraManager | None = None  # LoRA adapters, when the worker serves them

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @classmethod
    def load(cls, config: WorkerConfig) -> ModelRunner:
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        spec = load_model_spec(model_dir)
        device = resolve_device(config.device)
        parallel = join_group(config, spec, device)  # None without tensor parallelism
        if parallel is not None:
            device = parallel.device  # a CUDA rank's own GPU
        dtype = DTYPES[config.dtype]
        # Refused before the model loads.
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, device, dtype, config.attention_backend)
        max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        cpu_kernels = None
        if config.small_batch_linear and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            try:
                cpu_kernels = load_cpu_kernels(cache_dir_path(config.cache_dir))
            except CpuKernelBuildError as exc:
                logger.warning("small-batch linear kernel unavailable (%s)", exc)
        if config.weights == "native":
            weights, quantized_kernels = load_native_weights(config.model, spec, device, dtype,
                                                             cache_dir_path(config.cache_dir))
        else:
            weights, quantized_kernels = dict(load_state_dict(model_dir)), None
        int8 = int8_kernels(device, dtype, cache_dir_path(config.cache_dir)) if config.weights == "int8" else None
        if parallel is not None:  # this rank's share of the heads, MLP features and vocabulary
            weights = shard_weights(weights, spec, parallel.rank, parallel.size)
        try:
            model = DecoderModel(spec if parallel is None else shard_spec(spec, parallel.size), weights, device,
                                 dtype, max_model_len, cpu_kernels, quantized_kernels, parallel, int8)
        except MissingWeightError as exc:
            raise ModelLoadError(f"checkpoint in {model_dir} lacks tensor {exc.args[0]}") from exc
        del weights  # the model holds its own copies: the checkpoint's go before the KV cache is allocated
        budget = kv_cache_budget(device, config.kv_cache_memory, config.kv_cache_memory_fraction)
        if parallel is not None:  # equal block counts on every rank, however their free memory differs
            budget = parallel.agree_loaded(budget)
        # model.spec: a tensor-parallel rank caches only its own KV heads.
        kv_cache = KVCache.from_budget(model.spec, budget, config.block_size, device, cache_dtype, max_model_len)
        backend = make_attention_backend(config.attention_backend, device, cache_dir_path(config.cache_dir))
        if (cache_dtype == torch.int8 and dtype == torch.bfloat16 and isinstance(backend, CpuAttentionBackend)
                and spec.head_dim > backend.kernels.max_head_dim):
            raise ValueError(f"--kv-cache-dtype int8 with --dtype bfloat16 takes heads of up to "
                             f"{backend.kernels.max_head_dim} on the C kernels, not {spec.head_dim} (use "
                             "--attention-backend torch, or --kv-cache-dtype auto)")
        placement = model.describe_placement(backend, cache_dtype)
        # Said once, and loudly where the bfloat16 model lost its C kernels: no silent slow path.
        logger.log(logging.WARNING if model.mixed and backend.name != "cpu" else logging.INFO, "%s", placement)
        runner = cls(model, kv_cache, backend, config.max_num_seqs, max_model_len,
                     GrammarTokenizer.for_model(model_dir, spec), config.speculative_config, cpu_kernels)
        if config.lora_enabled:
            runner.lora = LoraManager.for_config(model, spec, config)
        release_freed_heap()
        return runner

    def reset(self) -> None:
        """Forget every request and restart step numbering: a new scheduler drives this worker.
        (The KV cache keeps stale contents; the new scheduler's block pool holds no hashes, so
        nothing reads them before they are overwritten.)"""
        for handle in list(self.batch.handle_of_row):
            self.batch.remove(handle)
        if self.batch.recent_outputs is not None:
            self.batch.recent_outputs.clear()
        self.prompt_logprobs.clear()
        self.pooler.clear()
        self.last_step = -1

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.step != self.last_step + 1:
            raise PlanError(f"step {plan.step} does not follow step {self.last_step}")
        self.batch.keep_recent_outputs(self.speculative)
        self.batch.apply(plan)
        self.prompt_logprobs.follow(plan, self.batch)
        self.pooler.follow(plan, self.batch)
        if self.lora is not None:
            self.lora.assign_rows(plan, self.batch)
        elif any(request.lora_name for request in plan.new_requests):
            raise PlanError("this worker serves no LoRA adapters")
        self.last_step = plan.step
        if not plan.scheduled_handles:
            return StepResult(step=plan.step, handles=[], sampled_token_ids=[])
        started = time.perf_counter()
        inputs = self.batch.prepare_inputs(plan, self.speculative)
        grammars = self._grammars_sampling(inputs) if self.batch.num_grammars else []
        mask = self._start_mask(len(inputs.logits_request), grammars) if grammars else None
        # Rows asking prompt logprobs add their chunks' positions after the sampling rows, embedding
        # requests' rows the positions they pool; no other row does.
        scored = self.prompt_logprobs.positions(plan, inputs, self.batch) if self.prompt_logprobs else None
        pooled = self.pooler.positions(plan, inputs, self.batch) if self.pooler else None
        if self.lora is not None:
            self.lora.begin_step(self.batch, inputs, self.model.device)
        try:
            logits = self._forward(inputs, scored, pooled)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if scored is not None:
            self.prompt_logprobs.record(scored, logits[len(inputs.logits_indices):])
            logits = logits[:len(inputs.logits_indices)]
        forward_done = time.perf_counter()
        sampling = self._sampling_batch(inputs)
        if mask is not None:
            sampling.token_bitmask, sampling.bitmask_rows = mask.result(), [i for i, _ in grammars]
        sampled = self.sampler(logits, sampling)
        token_ids = sampled.token_ids.cpu()
        produced = self.batch.finish_step(inputs, token_ids)
        for i, grammar in grammars:
            if grammar.active:  # not failed filling its mask
                grammar.advance(int(token_ids[i]))
        if self.batch.num_grammars:  # a failed request's tokens are not reported: it is ending
            produced &= ~self._grammar_failures(inputs)
        assert inputs.num_accepted is not None, "finish_step counts the accepted drafts"
        result = self._result(plan, inputs, produced, inputs.num_accepted, sampled)
        self._report_failures(plan, inputs, result)
        if self.prompt_logprobs:
            result.prompt_logprobs = self.prompt_logprobs.take(result.handles)
        if self.pooler:
            result.embeddings = self.pooler.take(result.handles)
        result.forward_seconds = forward_done - started
        result.sampling_seconds = time.perf_counter() - forward_done
        return result

    def _forward(self, inputs: StepInputs, scored: ScoredPositions | None, pooled: PooledPositions | None
                 ) -> torch.Tensor:
        """The logits at the sampling rows, then at the scored prompt positions; the pooled
        positions' final hidden states go to the pooler."""
        device = inputs.logits_indices.device
        indices = inputs.logits_indices if scored is None else torch.cat(
            [inputs.logits_indices, scored.indices.to(device)])
        if pooled is None:
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.attention, self.kv_cache,
                                      self.backend, indices)
        hidden = self.model.final_hidden(inputs.input_ids, inputs.positions, inputs.attention, self.kv_cache,
                                         self.backend, torch.cat([indices, pooled.indices.to(device)]))
        self.pooler.record(pooled, hidden[len(indices):])
        return self.model.compute_logits(hidden[:len(indices)])

    def _grammars_sampling(self, inputs: StepInputs) -> list[tuple[int, RowGrammar]]:
        """(logits row in the step, grammar) of the scheduled rows that sample a token this step
        with an active grammar (a prefill chunk short of its prompt's end samples nothing). A
        grammar's row never has drafts: it samples at one logits row."""
        b = self.batch
        rows = inputs.rows.tolist()
        samples = (b.num_computed_tokens[inputs.rows] + inputs.num_scheduled == b.num_tokens[inputs.rows]).tolist()
        first_logits = (torch.cumsum(inputs.num_drafts + 1, 0) - inputs.num_drafts - 1).tolist()
        return [(first_logits[i], grammar) for i, (row, sample) in enumerate(zip(rows, samples))
                if sample and (grammar := b.grammars[row]) is not None and grammar.active]

    def _start_mask(self, num_rows: int, grammars: list[tuple[int, RowGrammar]]) -> Future[torch.Tensor]:
        if not self.overlap_grammar_fill:
            done: Future[torch.Tensor] = Future()
            done.set_result(self.grammar_mask.fill(num_rows, grammars))
            return done
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vmesh-grammar-mask")
        return self._mask_thread.submit(self.grammar_mask.fill, num_rows, grammars)

    def _grammar_failures(self, inputs: StepInputs) -> torch.Tensor:
        """[num_reqs] bool: the scheduled requests whose grammar failed (now or earlier)."""
        grammars = self.batch.grammars
        return torch.tensor([(g := grammars[row]) is not None and bool(g.error) for row in inputs.rows.tolist()],
                            dtype=torch.bool)

    def _report_failures(self, plan: StepPlan, inputs: StepInputs, result: StepResult) -> None:
        """Each failed grammar's request, once: the scheduler ends it with the message."""
        if not self.batch.num_grammars:
            return
        for handle, row in zip(plan.scheduled_handles, inputs.rows.tolist()):
            grammar = self.batch.grammars[row]
            if grammar is not None and grammar.error and not grammar.error_reported:
                grammar.error_reported = True
                result.failed_handles.append(handle)
                result.failure_messages.append(grammar.error)
                logger.warning("request handle %d failed: %s", handle, grammar.error)

    def _sampling_batch(self, inputs: StepInputs) -> SamplingBatch:
        """One row per logits row: a draft's position samples under the tokens before it (its
        penalties, min_tokens and seed position), as it would without speculation. The checks run
        on numpy copies (PersistentBatch.prepare_inputs says why)."""
        b, rows, lengths = self.batch, inputs.sample_rows, inputs.sample_lengths
        row_list = rows.tolist()
        columns = b.sampling_columns(rows.numpy())
        device = self.model.device

        def on_device(name: str) -> torch.Tensor:
            column = torch.from_numpy(columns[name])
            return column if device.type == "cpu" else column.to(device)

        # One column per FLOAT_SAMPLING_FIELDS name, passed by that name: a field SamplingBatch lacks,
        # or one it has that the list lacks, fails here rather than sampling with a default.
        floats: dict[str, Any] = {name: on_device(name) for name in FLOAT_SAMPLING_FIELDS}
        sampling = SamplingBatch(
            top_k=on_device("top_k"), num_logprobs=on_device("num_logprobs"),
            generators=[b.generators[r] for r in row_list], seeds=[b.seeds[r] for r in row_list],
            positions=lengths.tolist(), **floats)
        if ((columns["repetition_penalty"] != 1.0) | (columns["presence_penalty"] != 0.0)
                | (columns["frequency_penalty"] != 0.0)).any():
            sampling.seen_token_ids, sampling.output_token_ids = self._penalty_tokens(rows, lengths)
        num_output = lengths.numpy() - columns["num_prompt_tokens"]
        if (num_output < columns["min_tokens"]).any():
            sampling.banned = self._banned_before_min_tokens(row_list, num_output.tolist())
        return sampling

    def _banned_before_min_tokens(self, rows: list[int],
                                  num_output: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, (row, produced) in enumerate(zip(rows, num_output)):
            params = self.batch.sampling[row]
            assert params is not None, "a row in the step holds a request"
            if produced < params.min_tokens:
                # A grammar decides where its output ends: EOS stays where it accepts (or it could allow nothing).
                keeps_eos = params.ignore_eos or self.batch.grammars[row] is not None
                ids = list(params.stop_token_ids) + ([] if keeps_eos else list(self.spec.eos_token_ids))
                banned_rows += [i] * len(ids)
                banned_ids += ids
        if not banned_ids:  # e.g. ignore_eos without stop ids: nothing to ban
            return None
        device = self.model.device
        return torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)

    def _penalty_tokens(self, rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        width = int(lengths.max())
        tokens = b.token_ids[rows, :width]
        index = torch.arange(width)
        known = index[None, :] < lengths[:, None]
        output = known & (index[None, :] >= b.num_prompt_tokens[rows][:, None])
        device = self.model.device
        return tokens.masked_fill(~known, -1).to(device), tokens.masked_fill(~output, -1).to(device)

    def _result(self, plan: StepPlan, inputs: StepInputs, produced: torch.Tensor, accepted: torch.Tensor,
                sampled: SamplerOutput) -> StepResult:
        handles = np.array(plan.scheduled_handles, dtype=np.int64)
        produced_np, accepted_np, logits_request = produced.numpy(), accepted.numpy(), inputs.logits_request.numpy()
        # A produced request keeps its samples up to the first rejected draft's position.
        kept_np = produced_np[logits_request] & (inputs.sample_offsets.numpy() <= accepted_np[logits_request])
        result = StepResult(step=plan.step, handles=handles[produced_np].tolist(),
                            sampled_token_ids=sampled.token_ids.cpu().numpy()[kept_np].tolist())
        if (num_drafts := inputs.num_drafts.numpy()).any():
            result.num_sampled_tokens = (accepted_np + 1)[produced_np].tolist()
            result.num_draft_tokens = num_drafts[produced_np].tolist()
        if sampled.logprob_rows is not None:
            kept = torch.from_numpy(kept_np)
            rows = sampled.logprob_rows.cpu()
            keep = kept[rows]
            rows = rows[keep]
            # The sampler computes the batch's widest top-N; each request keeps the N it asked for.
            counts = self.batch.num_logprobs[inputs.sample_rows[rows]].tolist()
            assert sampled.top_token_ids is not None and sampled.top_logprobs is not None
            assert sampled.sampled_logprobs is not None and sampled.sampled_ranks is not None
            top_ids = sampled.top_token_ids.cpu()[keep].tolist()
            top_lps = sampled.top_logprobs.cpu()[keep].tolist()
            result.logprobs_handles = handles[inputs.logits_request[rows].numpy()].tolist()
            result.logprobs = [TokenLogprobs(logprob, rank, ids[:n], lps[:n]) for logprob, rank, ids, lps, n in zip(
                sampled.sampled_logprobs.cpu()[keep].tolist(), sampled.sampled_ranks.cpu()[keep].tolist(),
                top_ids, top_lps, counts)]
        return result
