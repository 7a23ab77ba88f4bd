"""Seeded random LoRA adapters for the embedded model, made and saved by peft, and peft's own
greedy continuations with them (the reference vmesh's adapters are compared with)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.reference import NEAR_TIE, ReferenceOutput, hf_greedy


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Ranks, scalings and target sets differ, so that a mix-up between adapters (or bands) shows.
RECIPES = (
    AdapterRecipe("sql", 8, 16, ALL_TARGETS, seed=1),
    AdapterRecipe("poet", 4, 16, ("q_proj", "v_proj"), seed=2),
    AdapterRecipe("chef", 16, 16, ("o_proj", "gate_proj", "down_proj"), seed=3, use_rslora=True),
    AdapterRecipe("pirate", 8, 32, ("k_proj", "up_proj", "down_proj", "q_proj"), seed=4),
)
# lora_B's scale: large enough that every adapter changes the greedy tokens, small enough that
# their continuations stay ordinary text with clear top-1 margins.
B_STD = 0.06


def make_peft_model(model_dir: Path, out_dir: Path, recipes: tuple[AdapterRecipe, ...] = RECIPES,
                    b_std: float = B_STD):
    """(the peft model holding every recipe's adapter, {name: saved adapter directory})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    peft_model = None
    paths: dict[str, str] = {}
    for recipe in recipes:
        config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.targets),
                            lora_dropout=0.0, use_rslora=recipe.use_rslora)
        if peft_model is None:
            peft_model = get_peft_model(base, config, adapter_name=recipe.name)
        else:
            peft_model.add_adapter(recipe.name, config)
        generator = torch.Generator().manual_seed(recipe.seed)
        for module in peft_model.modules():
            if hasattr(module, "lora_A") and recipe.name in module.lora_A:
                a, b = module.lora_A[recipe.name].weight, module.lora_B[recipe.name].weight
                with torch.no_grad():
                    a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
                    b.copy_(torch.randn(b.shape, generator=generator) * b_std)
        peft_model.save_pretrained(str(out_dir), selected_adapters=[recipe.name])
        paths[recipe.name] = str(out_dir / recipe.name)  # peft saves a named adapter in its own folder
    assert peft_model is not None, "at least one recipe"
    peft_model.eval()
    return peft_model, paths


def assert_peft_greedy(peft_model, requests: list[tuple[list[int], list[int], str]]) -> None:
    """Each (prompt, our greedy output, adapter) is peft's greedy continuation: one teacher-forced
    forward pass of the whole batch, each row under its own adapter (peft's mixed-adapter batch;
    "" is the base model), must predict every next token. A divergence passes only at a genuine
    near-tie of peft's logits, after which the two continuations are not comparable."""
    width = max(len(prompt) + len(output) for prompt, output, _ in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)
    mask = torch.zeros(len(requests), width, dtype=torch.int64)
    for i, (prompt, output, _) in enumerate(requests):
        ids[i, :len(prompt) + len(output)] = torch.tensor(prompt + output)
        mask[i, :len(prompt) + len(output)] = 1
    with torch.inference_mode():
        logits = peft_model(input_ids=ids, attention_mask=mask,
                            adapter_names=[adapter or "__base__" for _, _, adapter in requests]).logits.float()
    for i, (prompt, output, adapter) in enumerate(requests):
        rows = logits[i, len(prompt) - 1:len(prompt) + len(output) - 1]
        for position, (ours, row) in enumerate(zip(output, rows)):
            expected = int(row.argmax())
            if ours != expected:
                top2 = row.topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap < NEAR_TIE, (f"request {i} (adapter {adapter!r}) diverges from peft at token {position}: "
                                        f"{ours} != {expected} (top-2 gap {gap:.2e}); ours {output}")
                break


def peft_greedy(peft_model, adapter: str | None, prompt: list[int], max_new_tokens: int) -> ReferenceOutput:
    """peft's greedy continuation with `adapter` active (None: the base model, adapters off)."""
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompt, max_new_tokens)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompt, max_new_tokens)
