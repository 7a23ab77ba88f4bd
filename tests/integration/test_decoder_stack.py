"""The decoder layers as one C call (services/worker/decoder_stack.py) against the per-op path,
bit for bit, on the default model's native weights and in `--weights int8 --dtype bfloat16`:
every step's final hidden states and the KV cache it leaves, over a workload that has decodes,
prefill chunks over cached context, steps that mix the two, and speculative verification rows;
and once more with what the default model lacks (q/k/v and o biases, a sliding window, a softmax
scale per layer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import CHAT_PROMPTS
from vmesh.kernels.cpu_native import load_cpu_kernels
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.attention import AttentionMetadata
from vmesh.services.worker.decoder_stack import stack_refusal
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.quantized_linear import DOT_ENV, QuantizedLinear

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)


def load_native(dot: str, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str = "auto") -> ModelRunner:
    monkeypatch.setenv(DOT_ENV, dot)  # read as the layers are built
    runner = ModelRunner.load(WorkerConfig(weights="native", kv_cache_memory=32 << 20, max_num_seqs=3,
                                           speculative_config=NGRAM, kv_cache_dtype=kv_cache_dtype))
    if dot == "int8" and not runner.model.layers[0].qkv_proj.integer:  # type: ignore[union-attr]
        pytest.skip("this CPU has no AVX-512 VNNI: the int8 products are the float ones")
    return runner


def load_int8_bf16(kv_cache_dtype: str = "auto") -> ModelRunner:
    if not load_cpu_kernels(Path(default_cache_dir())).integer_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: no --weights int8")
    return ModelRunner.load(WorkerConfig(weights="int8", dtype="bfloat16", kv_cache_memory=32 << 20,
                                         max_num_seqs=3, speculative_config=NGRAM, kv_cache_dtype=kv_cache_dtype))


def compare_every_step(runner: ModelRunner) -> Callable[[], tuple[set[tuple[bool, bool, bool]], int, int]]:
    """Makes each forward run the per-op path, then the stack from the same KV cache, asserting
    equal hidden states and caches; returns what reports (the kinds of steps seen, the steps
    compared, the stack's runs)."""
    model = runner.model
    assert stack_refusal(model) is None
    stack = model._decoder_stack()
    assert stack is not None, "the default model's native layers run as one call"
    final_hidden, execute, run = model.final_hidden, runner.execute, stack.run
    seen: set[tuple[bool, bool, bool]] = set()
    plans: list = []
    stack_runs = compared = 0

    def recorded_execute(plan):
        plans.append(plan)
        return execute(plan)

    def counted_run(*args):
        nonlocal stack_runs
        stack_runs += 1
        return run(*args)

    def both_paths(input_ids, positions, meta, kv_cache, backend, indices):
        nonlocal compared
        if not stack.serves(backend, kv_cache, input_ids.numel()):  # the int8 stack: 8 rows or more
            return final_hidden(input_ids, positions, meta, kv_cache, backend, indices)
        compared += 1
        caches = [*kv_cache.key_caches, *kv_cache.value_caches]
        before = [c.clone() for c in caches]
        model.decoder_stack_enabled = False
        reference = final_hidden(input_ids, positions, meta, kv_cache, backend, indices)
        after_reference = [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        model.decoder_stack_enabled = True
        stacked = final_hidden(input_ids, positions, meta, kv_cache, backend, indices)
        assert torch.equal(stacked, reference), f"step of {input_ids.numel()} tokens"
        assert all(torch.equal(c, r) for c, r in zip(caches, after_reference)), "the KV caches differ"
        (only,) = meta if isinstance(meta, list) else [meta]
        decodes, chunks = step_kinds(only)
        seen.add((decodes, chunks, any(plans[-1].num_draft_slots)))
        return stacked

    model.final_hidden = both_paths  # type: ignore[method-assign]
    runner.execute = recorded_execute  # type: ignore[method-assign]
    stack.run = counted_run  # type: ignore[method-assign]
    return lambda: (seen, compared, stack_runs)


def step_kinds(meta: AttentionMetadata) -> tuple[bool, bool]:
    """(whether the step had decodes, whether it had prefill chunks or verification rows)."""
    items, chunks = meta.backend_cache["cpu_plan"]
    return items is not None, chunks is not None


def generate(runner: ModelRunner, tokenizer) -> list[list[int]]:
    """3 sequences over 5 prompts with small token budgets: chunked prefills beside running decodes;
    a repeated passage gives n-gram drafts."""
    prompts = [tokenizer.encode(p) for p in CHAT_PROMPTS[:3]]
    prompts += [tokenizer.encode("one two three four five six seven eight " * 12)] * 2
    config = EngineConfig(max_num_batched_tokens=40, max_prefill_tokens_with_decodes=16)
    engine = LLMEngine(runner, tokenizer, config)
    try:
        outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True)
                                            for i in range(len(prompts))])
    finally:
        engine.shutdown()
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("dot", ["int8", "float"])
def test_the_stack_equals_the_layers_one_by_one(dot, embedded_tokenizer, monkeypatch):
    runner = load_native(dot, monkeypatch)
    report = compare_every_step(runner)
    outputs = generate(runner, embedded_tokenizer)
    assert [len(o) for o in outputs] == [12 + 4 * i for i in range(len(outputs))]
    seen, compared, stack_runs = report()
    kinds = {(d, c) for d, c, _ in seen}
    assert {(True, False), (False, True), (True, True)} <= kinds, kinds
    assert any(drafts for *_, drafts in seen), "no step verified drafts"
    assert stack_runs == compared > 20, "the stack ran at every step"


def test_the_int8_bf16_stack_equals_the_layers_one_by_one(embedded_tokenizer):
    """`--weights int8 --dtype bfloat16`: every step of 8 rows or more through the stack equals the per-op
    path bit for bit (fewer rows take the 16-bit products, one by one); both attention kernels over the
    bfloat16 cache, and verification rows, among them."""
    runner = load_int8_bf16()
    report = compare_every_step(runner)
    outputs = generate(runner, embedded_tokenizer)
    assert [len(o) for o in outputs] == [12 + 4 * i for i in range(len(outputs))]
    seen, compared, stack_runs = report()
    kinds = {(d, c) for d, c, _ in seen}
    assert {(True, True), (False, True)} <= kinds, kinds
    assert stack_runs == compared > 5, (stack_runs, compared)


@pytest.mark.parametrize("mode", ["native", "int8-bf16"])
def test_the_stack_over_the_int8_kv_cache_equals_the_layers_one_by_one(mode, embedded_tokenizer, monkeypatch):
    """`--kv-cache-dtype int8` (vmesh/kernels/cpu/kv_int8.h) in both stacks: the same bits and the same
    8-bit cache as the per-op path, decodes and prefill chunks among the steps."""
    runner = load_native("float", monkeypatch, "int8") if mode == "native" else load_int8_bf16("int8")
    assert runner.kv_cache.key_caches[0].dtype == torch.int8
    report = compare_every_step(runner)
    outputs = generate(runner, embedded_tokenizer)
    assert [len(o) for o in outputs] == [12 + 4 * i for i in range(len(outputs))]
    seen, compared, stack_runs = report()
    kinds = {(d, c) for d, c, _ in seen}
    # The int8 stack takes steps of 8 rows or more: with 3 sequences, decodes come beside chunks.
    assert ({(True, False), (False, True), (True, True)} if mode == "native" else {(True, True), (False, True)}) \
        <= kinds, kinds
    assert stack_runs == compared > (20 if mode == "native" else 5), (stack_runs, compared)


@pytest.mark.parametrize("mode", ["native", "int8-bf16"])
def test_biases_windows_and_scales_reach_the_stack(mode, embedded_tokenizer, monkeypatch):
    """Each layer's q/k/v and o get a bias, a softmax scale of its own and, on every other layer, a
    sliding window of 8, before the first step (the stack reads them then)."""
    runner = load_native("float", monkeypatch) if mode == "native" else load_int8_bf16()
    generator = torch.Generator().manual_seed(0)
    for i, layer in enumerate(runner.model.layers):
        for name in ("qkv_proj", "o_proj"):
            linear = getattr(layer, name)
            bias = 0.05 * torch.randn(linear.out_features, generator=generator)
            if mode == "native":
                setattr(layer, name, QuantizedLinear(linear.quantized, bias, linear.kernels))
            else:
                linear.bias = bias
        layer.scale *= 1 + 0.02 * i
        if i % 2:
            layer.plan = dataclasses.replace(layer.plan, attention=dataclasses.replace(layer.plan.attention, window=8))
    report = compare_every_step(runner)
    generate(runner, embedded_tokenizer)
    _, compared, stack_runs = report()
    assert stack_runs == compared > (20 if mode == "native" else 5)


def test_models_the_stack_does_not_serve_run_one_by_one():
    """The dequantized default model: float linears, so the layers run one by one, as before."""
    runner = ModelRunner.load(WorkerConfig(weights="dequantized", kv_cache_memory=8 << 20, max_num_seqs=1))
    assert stack_refusal(runner.model) == "a projection that is not a plain quantized linear"
    assert runner.model._decoder_stack() is None
