"""The in-process engine: tokenizer, scheduler, worker and detokenizer in one process.

It is a library entry point and the baseline the mesh is measured against; it drives the
same step plans the mesh carries. Its scheduler defaults are offline ones (EngineConfig);
serving_scheduler_defaults() gives it the mesh's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vmesh.services.common.admission import InvalidRequest, admit, check_adapter
from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.common.output_accumulator import OutputAccumulator
from vmesh.services.common.structured import GrammarCompiler, GrammarRefused
from vmesh.services.common.tokenizer import encode_chat, load_chat_tokenizer
from vmesh.services.common.types import FinishReason, ModelLimits, SamplingParams, StepTokens, TokenLogprobs
from vmesh.services.detokenizer.output_processor import OutputProcessor
from vmesh.services.engine.core import EngineCore, model_thread
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler, WorkerGeometry
from vmesh.services.scheduler.settings import SchedulerSettings
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


@dataclass(kw_only=True)  # fields by name: the inherited scheduler settings come first
class EngineConfig(SchedulerSettings):
    """The scheduler's settings and the worker's, for one process."""
    # Unbounded unless set: a library caller may add a whole offline batch before stepping.
    max_waiting: int | None = None
    # No decode-first cap unless set: offline, a batch's total time is what counts, and beside
    # running decodes the cap admits one 256-token prompt per step, so a batch of long prompts
    # enters over dozens of narrow steps (on 64 x 256-token prompts in bfloat16 the capped engine
    # ran 276-285 tok/s against 334-364 uncapped; benchmarks/README.md, "oneDNN's packing hint by
    # row count"). The mesh's scheduler keeps the cap; serving_scheduler_defaults() gives it back.
    max_prefill_tokens_with_decodes: int = 0
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        if self.stateless_worker:
            raise ValueError("stateless_worker (--stateless-worker) is a mode of the mesh's worker protocol; the "
                             "in-process engine has no protocol to resend")


def serving_scheduler_defaults() -> dict[str, Any]:
    """The scheduler settings in which EngineConfig's offline defaults differ from the mesh's
    scheduler, at the mesh's values: keyword arguments for an engine that is to schedule as the
    mesh does (a benchmark's reference for the mesh's worker)."""
    serving, offline = SchedulerSettings(), EngineConfig()
    return {f.name: getattr(serving, f.name) for f in dataclasses.fields(SchedulerSettings)
            if getattr(serving, f.name) != getattr(offline, f.name)}


@dataclass
class RequestOutput:
    request_id: str
    text: str  # per the request's output mode
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    error: str = ""  # non-empty: the request failed alone (finish_reason ABORT), e.g. its grammar matcher
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first tokens, if asked
    embedding: list[float] = field(default_factory=list)  # with an embedding request's first token


@dataclass
class CompletionOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str = ""  # non-empty: the request failed alone (finish_reason ABORT)
    # SamplingParams.prompt_logprobs set: one row per prompt token from the second on.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.pooling set: the prompt's pooled final hidden states.
    embedding: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Any, config: EngineConfig,
                 model_thread: ThreadPoolExecutor | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.config = config
        # The mesh's limits for the same model: a request the mesh refuses, this door refuses too.
        self.limits = ModelLimits(config.worker.model or "", runner.max_model_len, runner.spec.vocab_size)
        kv = runner.kv_cache
        scheduler = Scheduler.for_worker(config, WorkerGeometry(
            max_model_len=runner.max_model_len, max_num_seqs=runner.batch.max_num_reqs, num_kv_blocks=kv.num_blocks,
            block_size=kv.block_size, eos_token_ids=tuple(runner.spec.eos_token_ids),
            num_speculative_tokens=runner.speculative.num_speculative_tokens if runner.speculative else 0,
            speculative_disable_by_batch_size=runner.speculative.disable_by_batch_size if runner.speculative else 0,
            max_loras=runner.lora.max_loras if runner.lora else 0, kv_cache_windows=kv.layout.windows))
        self.core = EngineCore(scheduler, runner, config.pipeline_depth, model_thread)
        self.outputs: OutputProcessor[str] = OutputProcessor(self.backend_tokenizer)  # by request id
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._driver: _AsyncDriver | None = None
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first structured request

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        # config.worker.model stays as given: the runner resolves it itself, and `--weights native`
        # reads the GGUF file behind it, not the directory converted from that file.
        model_dir = resolve_model_dir(config.worker.model, config.worker.cache_dir)
        # The frontend's tokenizer and template: the same ids at every door.
        tokenizer = load_chat_tokenizer(model_dir, config.worker.chat_template)
        thread = model_thread()
        try:
            return cls(thread.submit(ModelRunner.load, config.worker).result(), tokenizer, config, thread)
        except BaseException:
            thread.shutdown(wait=False, cancel_futures=True)
            raise

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # --- requests ----------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, lora_name: str = "") -> str:
        """Raises admission.InvalidRequest (a ValueError naming the field) for a request the
        model cannot serve, by the rules of the mesh's doors. `lora_name`: a LoRA adapter the
        runner holds ("": the base model)."""
        params = self._compiled(params or SamplingParams())
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        admit(token_ids, params, self.limits)
        check_adapter(lora_name, set(self.runner.lora.names()) if self.runner.lora else set())
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, token_ids, params, priority=priority, lora_name=lora_name)
        with self._lock:
            self.scheduler.add_request(request)
            self.outputs.add_request(request_id, params, token_ids, len(token_ids))
        return request_id

    def _compiled(self, params: SamplingParams) -> SamplingParams:
        """`params` with its structured output compiled (as the mesh's frontend compiles it), by
        the compiler of the worker's own tokenizer; the caller's object is left as it was."""
        if params.grammar is not None:
            raise InvalidRequest("sampling.grammar", "is compiled from sampling.structured; set structured instead")
        if params.structured is None:
            return params
        grammar_tokenizer = self.runner.batch.grammar_tokenizer
        if grammar_tokenizer is None:
            raise InvalidRequest("sampling.structured", "this model has no tokenizer.json to compile grammars with")
        with self._lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(grammar_tokenizer.tokenizer_json, grammar_tokenizer.vocab_size,
                                                         list(grammar_tokenizer.stop_token_ids))
            compiler = self._grammar_compiler
        try:
            grammar = compiler.compile(params.structured)
        except GrammarRefused as exc:
            field_name = f"sampling.structured.{exc.path}" if exc.path else "sampling.structured"
            raise InvalidRequest(field_name, exc.detail) from exc
        return dataclasses.replace(params, grammar=grammar)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self.outputs.pop(request_id)
            return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no request is using; returns the number of blocks dropped."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    # --- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        updates = self.core.step()
        with self._lock:
            processed, stopped = self.outputs.process(
                StepTokens(u.request_id, u.new_token_ids, u.finish_reason, u.num_cached_prompt_tokens, u.logprobs,
                           u.error, u.prompt_logprobs, u.embedding) for u in updates)
            for request_id in stopped:  # a stop string ended it: the core would compute it on
                self.scheduler.abort(request_id, FinishReason.STOP)
        return [RequestOutput(p.handle, p.text, p.token_ids, p.finished, p.finish_reason, p.logprobs,
                              p.state.num_prompt_tokens, p.state.num_output_tokens, p.num_cached_prompt_tokens, p.error,
                              p.prompt_logprobs, p.embedding)
                for p in processed]

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        outputs = {i: OutputAccumulator[TokenLogprobs].for_mode(sp.output_mode) for i, sp in zip(ids, params_list)}
        results = {i: CompletionOutput(i, "", [], None, 0, 0) for i in ids}
        while self.has_unfinished():
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                outputs[out.request_id].extend(out.text, out.new_token_ids, out.logprobs)
                result.num_prompt_tokens = out.num_prompt_tokens
                result.num_cached_prompt_tokens = out.num_cached_prompt_tokens
                result.prompt_logprobs = result.prompt_logprobs or out.prompt_logprobs
                result.embedding = result.embedding or out.embedding
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.error = out.error
        for i, output in outputs.items():
            # Stop strings cut text; token ids after the cut were already generated and stay listed.
            results[i].text, results[i].token_ids, results[i].logprobs = output.text, output.token_ids, output.logprobs
        return [results[i] for i in ids]

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the engine steps in a background thread shared by all
        concurrent streams. Cancelling the iterator aborts the request."""
        if self._driver is None:
            self._driver = _AsyncDriver(self)
        driver = self._driver
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = self.add_request(prompt, params, request_id)
        driver.subscribe(request_id, queue)
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            driver.unsubscribe(request_id)
            self.abort(request_id)

    def shutdown(self) -> None:
        if self._driver is not None:
            self._driver.stop()
            self._driver = None
        self.core.shutdown()


class _AsyncDriver:
    """Steps an engine on a thread while any async stream is open."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="vmesh-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join()

    def subscribe(self, request_id: str, queue: asyncio.Queue) -> None:
        self.subscribers[request_id] = (asyncio.get_running_loop(), queue)
        self.wake.set()

    def unsubscribe(self, request_id: str) -> None:
        self.subscribers.pop(request_id, None)

    def _run(self) -> None:
        while not self.stopped:
            if not self.engine.has_unfinished():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for out in self.engine.step():
                target = self.subscribers.get(out.request_id)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)
