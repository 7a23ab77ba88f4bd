"""Every model family against transformers float32, greedy, token for token: seeded random tiny
models from transformers' own config classes (Qwen3, Mistral, Qwen3-MoE, Mixtral, Gemma 3) through the
worker (C kernels and torch attention), the in-process engine at pipeline depth 1 and 2 with
chunked prefill, tensor parallelism and a real mesh; and weight transplants, SmolLM2's weights
re-declared as other families, which must reproduce SmolLM2's own tokens (or transformers' on the
transplanted weights, where the new layout changes the function: Qwen3's QK-norm)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from tests.support.plan_driver import DrivenRequest, drive
from tests.support.reference import ReferenceOutput, assert_greedy_match, hf_greedy
from tests.support.tiny_models import TINY_FAMILIES, TINY_VOCAB, TINY_WINDOW, transplant
from vmesh.services.common.model_loading import load_model_spec
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

# Most longer than the tiny window (12), so that windows slide past block edges; 1: a lone token.
PROMPT_LENGTHS = (5, 17, 40, 1, 33)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_tokenizer):
    """kind -> (checkpoint dir, transformers model, prompts, greedy references). Each directory
    also holds the embedded tokenizer (its first ids decode), for the engine and the mesh."""
    made = {}
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    for kind, save in TINY_FAMILIES.items():
        path = tmp_path_factory.mktemp(kind)
        model = save(path)
        embedded_tokenizer.save_pretrained(path)
        made[kind] = (path, model, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts])
    return made


def test_each_family_declares_its_plan(tiny):
    """What the plans say, read back from the saved configs: the features under test are on."""
    plans = {kind: load_model_spec(path).layers for kind, (path, *_rest) in tiny.items()}
    assert all(layer.attention.qk_norm for kind in ("qwen3", "qwen3_moe") for layer in plans[kind])
    assert all(layer.attention.window == TINY_WINDOW for kind in ("mistral", "mixtral") for layer in plans[kind])
    assert all(layer.attention.window is None for kind in ("qwen3", "qwen3_moe") for layer in plans[kind])
    moe = [(layer.mlp.num_experts, layer.mlp.experts_per_token) for kind in ("qwen3_moe", "mixtral")
           for layer in plans[kind]]
    assert set(moe) == {(4, 2)}
    assert not any(layer.mlp.is_moe for kind in ("qwen3", "mistral", "gemma3") for layer in plans[kind])
    gemma = plans["gemma3"]
    assert [layer.attention.window for layer in gemma] == [TINY_WINDOW, None, TINY_WINDOW]
    assert gemma[0].attention.rope_theta != gemma[1].attention.rope_theta  # local and global RoPE bases
    assert all(layer.norms == "sandwich" and layer.mlp.activation == "gelu_tanh" for layer in gemma)


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tiny_family_greedy_parity(tiny, kind, backend):
    """Ragged batches, requests joining late, prefill in chunks of 7 across the window's edge."""
    path, _model, prompts, references = tiny[kind]
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           attention_backend=backend))
    assert runner.backend.name == ("cpu" if backend == "auto" else "torch")
    requests = [DrivenRequest(p, NEW_TOKENS, join_step=2 * i) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=7)
    for i, r in enumerate(requests):
        assert_greedy_match(r.output, references[i], label=f"{kind} ({backend}) request {i}")


def test_sliding_window_model_on_the_triton_backend(tiny):
    """Mixtral (window and experts) through the Triton kernels in the interpreter."""
    pytest.importorskip("triton")
    path, _model, prompts, references = tiny["mixtral"]
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           attention_backend="triton"))
    requests = [DrivenRequest(p, 8, join_step=i) for i, p in enumerate(prompts[1:3])]
    drive(runner, requests, chunk=8)
    for i, r in enumerate(requests):
        reference = references[i + 1]
        assert_greedy_match(r.output, ReferenceOutput(reference.token_ids[:8], reference.logits[:8]),
                            label=f"mixtral triton request {i}")


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
@pytest.mark.parametrize("depth", [1, 2])
def test_tiny_family_through_the_engine(tiny, embedded_tokenizer, kind, depth):
    """The scheduler's chunked prefill (10 tokens a step: chunks that straddle the window's edge)
    at pipeline depth 1 and 2."""
    path, _model, prompts, references = tiny[kind]
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=4 << 20, max_num_seqs=8))
    engine = LLMEngine(runner, embedded_tokenizer, EngineConfig(max_num_batched_tokens=10, pipeline_depth=depth))
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        for i, out in enumerate(outs):
            assert_greedy_match(out.token_ids, references[i], label=f"{kind} engine depth {depth} prompt {i}")
        assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
        # Windowed layers gave back the blocks behind their window while the requests ran.
        windowed = any(layer.attention.window for layer in runner.spec.layers)
        assert (engine.scheduler.kv.num_freed_behind_windows > 0) == windowed
    finally:
        engine.shutdown()


def _small_pool_engine(runner: ModelRunner, tokenizer) -> LLMEngine:
    """An engine at depth 2 in 10-token steps whose scheduler hands out only 6 blocks per KV
    cache group: too few for every request at once."""
    num_blocks, runner.kv_cache.num_blocks = runner.kv_cache.num_blocks, 6 * runner.kv_cache.num_groups
    try:
        return LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=10, pipeline_depth=2))
    finally:
        runner.kv_cache.num_blocks = num_blocks


@pytest.mark.parametrize("kind, backend", [("gemma3", "auto"), ("mistral", "auto"), ("gemma3", "triton")])
def test_window_groups_through_preemption_and_prefix_hits(tiny, embedded_tokenizer, kind, backend):
    """KV cache groups on a real model: the window groups give back the blocks behind their
    window while requests run, a pool too small for every request preempts, and the same prompts
    again hit the prefix cache (global and window groups), token for token both times."""
    if backend == "triton":
        pytest.importorskip("triton")
    path, _model, prompts, references = tiny[kind]
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           attention_backend=backend))
    engine = _small_pool_engine(runner, embedded_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        for i, out in enumerate(engine.generate(prompts, params)):
            assert_greedy_match(out.token_ids, references[i], label=f"{kind} {backend} prompt {i}")
        scheduler = engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.kv.num_freed_behind_windows > 0
        long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        for round_ in ("again", "cached"):  # the second run finds the first's blocks in every group
            hits = scheduler.pool.prefix_hits
            [out] = engine.generate([prompts[long]], params)
            assert_greedy_match(out.token_ids, references[long], label=f"{kind} {backend} {round_} prompt {long}")
        assert scheduler.pool.prefix_hits - hits == (len(prompts[long]) - 1) // runner.kv_cache.block_size > 0
        assert scheduler.pool.num_free == scheduler.pool.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind, preempts", [("gemma3", True), ("mistral", False)])
def test_speculation_on_window_groups_changes_no_token(tiny, embedded_tokenizer, kind, preempts):
    """n-gram drafts on a model with sliding-window layers, at depth 2 in a small pool (Gemma 3's
    requests are preempted in it; Mistral's, whose every layer frees behind its window, fit): the
    draft slots a window group reserves and the blocks it frees behind the window agree, token for
    token with transformers."""
    from vmesh.services.speculative.config import SpeculativeConfig

    path, _model, prompts, references = tiny[kind]
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=4 << 20, max_num_seqs=8))
    runner.speculative = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _small_pool_engine(runner, embedded_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        for i, out in enumerate(engine.generate(prompts, params)):
            assert_greedy_match(out.token_ids, references[i], label=f"{kind} speculative prompt {i}")
        scheduler = engine.scheduler
        assert scheduler.spec_stats.num_draft_tokens > 0 and scheduler.kv.num_freed_behind_windows > 0
        assert (scheduler.num_preemptions > 0) == preempts
        assert scheduler.pool.num_free == scheduler.pool.num_blocks
    finally:
        engine.shutdown()
        runner.speculative = None


def test_the_window_matters_in_these_tests(tiny, tmp_path):
    """The same Mistral weights declared without a window diverge from transformers' windowed
    output: the parity above could not pass with the window ignored."""
    import json

    path, _model, prompts, references = tiny["mistral"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    runner = ModelRunner.load(WorkerConfig(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=8))
    requests = [DrivenRequest(p, NEW_TOKENS) for p in prompts]
    drive(runner, requests)
    long_ones = [i for i, p in enumerate(prompts) if len(p) > TINY_WINDOW]
    assert any(requests[i].output != references[i].token_ids for i in long_ones)
    assert requests[0].output[:3] == references[0].token_ids[:3], "a prompt inside the window is unchanged"


# --- weight transplants -------------------------------------------------------------------------

TRANSPLANT_PROMPTS = 2


@pytest.fixture(scope="module")
def smollm2_references(chat_prompt_ids, embedded_reference_model):
    prompts = chat_prompt_ids[:TRANSPLANT_PROMPTS]
    return prompts, [hf_greedy(embedded_reference_model, p, NEW_TOKENS) for p in prompts]


def _vmesh_greedy(model_dir, prompts) -> list[list[int]]:
    runner = ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=32 << 20, max_num_seqs=4))
    requests = [DrivenRequest(p, NEW_TOKENS, join_step=i) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=16)
    return [r.output for r in requests]


# Each: the family's architecture and model type, and what its layout adds to SmolLM2's config.
# Windows at least the context (8,192) leave attention global; two experts, both chosen, copies of
# the dense MLP: any routing weights that sum to one give the dense output.
SMOLLM2_EQUIVALENTS = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False}),
    "mistral": ("MistralForCausalLM", "mistral", {"sliding_window": 8192}),
    "mixtral": ("MixtralForCausalLM", "mixtral", {"sliding_window": 8192, "num_local_experts": 2,
                                                  "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("kind", list(SMOLLM2_EQUIVALENTS))
def test_smollm2_transplant_reproduces_smollm2(tmp_path, embedded_model_dir, smollm2_references, kind):
    architecture, model_type, changes = SMOLLM2_EQUIVALENTS[kind]
    experts = changes.get("num_local_experts", 0)
    transplant(embedded_model_dir, tmp_path, architecture, model_type, experts=experts, **changes)
    spec = load_model_spec(tmp_path)
    assert spec.architecture == architecture
    prompts, references = smollm2_references
    for i, output in enumerate(_vmesh_greedy(tmp_path, prompts)):
        assert_greedy_match(output, references[i], label=f"SmolLM2 as {kind}, prompt {i}")


def _transformers_greedy(model_dir, prompts) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_smollm2_as_qwen3_matches_transformers_on_the_same_weights(tmp_path, embedded_model_dir, smollm2_references):
    """QK-norm weights of one still normalise each head (RMSNorm is not the identity): the oracle is
    transformers' Qwen3 on the transplanted weights, and the output differs from SmolLM2's."""
    transplant(embedded_model_dir, tmp_path, "Qwen3ForCausalLM", "qwen3")
    prompts, smollm2 = smollm2_references
    references = _transformers_greedy(tmp_path, prompts)
    outputs = _vmesh_greedy(tmp_path, prompts)
    for i, output in enumerate(outputs):
        assert_greedy_match(output, references[i], label=f"SmolLM2 as Qwen3, prompt {i}")
    assert any(output != s.token_ids for output, s in zip(outputs, smollm2))


def test_smollm2_with_a_short_window_matches_transformers_mistral(tmp_path, embedded_model_dir, embedded_tokenizer,
                                                                  smollm2_references):
    """A real model's weights under a 24-token window, shorter than the prompts: through the engine,
    prefill chunks of 16 tokens cross the window's edge."""
    transplant(embedded_model_dir, tmp_path, "MistralForCausalLM", "mistral", sliding_window=24)
    prompts, _smollm2 = smollm2_references
    assert all(len(p) > 24 for p in prompts)
    references = _transformers_greedy(tmp_path, prompts)
    runner = ModelRunner.load(WorkerConfig(model=str(tmp_path), kv_cache_memory=32 << 20, max_num_seqs=4))
    engine = LLMEngine(runner, embedded_tokenizer, EngineConfig(max_num_batched_tokens=16, pipeline_depth=2))
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        engine.shutdown()
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, references[i], label=f"SmolLM2 windowed, prompt {i}")


# --- tensor parallelism and a real mesh ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_tp2_matches_tp1(tiny, tmp_path, kind):
    """Two ranks, each holding half of every expert's features (and of the heads): the harness of
    test_tensor_parallel.py, greedy and seeded sampling equal to one unsharded worker."""
    from tests.integration.test_tensor_parallel import run_group, run_unsharded

    path = tiny[kind][0]
    expected = run_unsharded(str(path), "tiny")
    _codes, results = run_group(tmp_path, str(path), 2, "tiny")
    rank0, rank1 = results
    assert rank0 is not None and rank1 == rank0
    assert rank0["greedy"] == expected["greedy"]
    assert rank0["seeded"] == expected["seeded"]


@pytest.mark.parametrize("kind, ranks", [("mixtral", 2), ("gemma3", 1)])
def test_sliding_window_models_through_the_mesh(tiny, kind, ranks):
    """Served by `vmesh serve` over gRPC, greedy tokens equal to transformers': Mixtral (window
    and experts) on two tensor-parallel worker ranks, and Gemma 3 (local and global layers: KV
    cache groups, which the worker's start-up step must hand a block each)."""
    from tests.support.meshes import stops_cleanly
    from vmesh.services.bench.mesh import start_mesh
    from vmesh.services.client import VmeshClient

    path, _model, prompts, references = tiny[kind]

    async def greedy_all(address: str) -> list[list[int]]:
        async with VmeshClient(address) as client:
            results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=NEW_TOKENS, temperature=0.0,
                                                             ignore_eos=True) for p in prompts))
        return [ids for _text, ids, _last in results]

    with stops_cleanly(start_mesh("--model", str(path), "--tensor-parallel-size", str(ranks),
                                  "--max-num-batched-tokens", "10")) as mesh:
        outputs = asyncio.run(greedy_all(mesh.address))
    for i, ids in enumerate(outputs):
        assert_greedy_match(ids, references[i], label=f"{kind} mesh prompt {i}")
