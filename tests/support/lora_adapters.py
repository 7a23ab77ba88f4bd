"""Seeded random LoRA adapters for the embedded model, made and saved by peft, and peft's own
greedy continuations with them (the reference vmesh's adapters are compared with)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.reference import ReferenceOutput, hf_greedy


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
    AdapterRecipe("poet", 4, 8, ("q_proj", "v_proj"), seed=2),
    AdapterRecipe("chef", 16, 16, ("o_proj", "gate_proj", "down_proj"), seed=3, use_rslora=True),
    AdapterRecipe("pirate", 8, 32, ("k_proj", "up_proj", "down_proj", "q_proj"), seed=4),
)
# lora_B's scale: large enough that every adapter changes the greedy tokens, small enough that
# their continuations stay ordinary text with clear top-1 margins.
B_STD = 0.06


def make_peft_model(model_dir: Path, out_dir: Path, recipes: tuple[AdapterRecipe, ...] = RECIPES):
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
        for module_name, module in peft_model.named_modules():
            if hasattr(module, "lora_A") and recipe.name in module.lora_A:
                a, b = module.lora_A[recipe.name].weight, module.lora_B[recipe.name].weight
                with torch.no_grad():
                    a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
                    b.copy_(torch.randn(b.shape, generator=generator) * B_STD)
        peft_model.save_pretrained(str(out_dir), selected_adapters=[recipe.name])
        paths[recipe.name] = str(out_dir / recipe.name)  # peft saves a named adapter in its own folder
    assert peft_model is not None, "at least one recipe"
    peft_model.eval()
    return peft_model, paths


def peft_greedy(peft_model, adapter: str | None, prompt: list[int], max_new_tokens: int) -> ReferenceOutput:
    """peft's greedy continuation with `adapter` active (None: the base model, adapters off)."""
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, prompt, max_new_tokens)
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, prompt, max_new_tokens)
