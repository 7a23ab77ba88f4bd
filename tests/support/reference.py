"""Hugging Face transformers as the reference for greedy parity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Greedy parity: a mismatch is accepted only where the reference's top-two logits are this close.
NEAR_TIE = 1e-4


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    logits: list[torch.Tensor]  # one [vocab] row per generated token


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> ReferenceOutput:
    """Greedy continuation that ignores EOS, as vmesh does with ignore_eos."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    # generate() fills unset fields from the model's own generation config, EOS included.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device))
    finally:
        model.generation_config.eos_token_id = saved_eos
    return ReferenceOutput(out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits])


def assert_greedy_match(ours: list[int], reference: ReferenceOutput, label: str = "") -> None:
    """Token-for-token equality; a divergence passes only at a genuine near-tie of the reference."""
    for i, (a, b) in enumerate(zip(ours, reference.token_ids)):
        if a != b:
            top2 = reference.logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (f"{label} diverges at token {i}: {a} != {b} (reference top-2 gap {gap:.2e})\n"
                                    f"ours {ours}\nref  {reference.token_ids}")
            return
    assert len(ours) == len(reference.token_ids), f"{label}: {len(ours)} tokens vs {len(reference.token_ids)}"


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float32: the log-softmax at each position before the last, the
    row that scores prompt token i + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=model.device)).logits[0, :-1].float()
    return logits.log_softmax(dim=-1).cpu()


def assert_prompt_logprobs_match(rows, prompt: list[int], reference: torch.Tensor, num_top: int,
                                 tolerance: float = 1e-4) -> None:
    """`rows` (TokenLogprobs, or anything with logprob, rank, top_token_ids, top_logprobs) score
    prompt[1:] as `reference` does: logprob, rank and top-N values within `tolerance`; each top
    id's reference logprob equal to the value beside it (ties may order differently)."""
    assert len(rows) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    expected = reference.gather(1, targets[:, None]).squeeze(1)
    ours = torch.tensor([r.logprob for r in rows])
    assert torch.allclose(ours, expected, atol=tolerance, rtol=0), float((ours - expected).abs().max())
    top = reference.topk(num_top, dim=-1).values if num_top else reference[:, :0]
    for i, r in enumerate(rows):
        assert len(r.top_token_ids) == num_top
        assert torch.allclose(torch.tensor(r.top_logprobs), top[i], atol=tolerance, rtol=0)
        assert torch.allclose(reference[i, r.top_token_ids], torch.tensor(r.top_logprobs), atol=tolerance, rtol=0)
        higher = int((reference[i] > expected[i] + tolerance).sum())
        assert higher + 1 <= r.rank <= int((reference[i] > expected[i] - tolerance).sum()) + 1


def hf_final_hidden(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), hidden] float32: the base model's last_hidden_state, after the final norm."""
    with torch.inference_mode():
        return model.base_model(torch.tensor([prompt], device=model.device)).last_hidden_state[0].float().cpu()


def pooled(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    """Final hidden states (hf_final_hidden's) pooled as vLLM's pooling type names it."""
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def hf_embedding(model, prompt: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    return pooled(hf_final_hidden(model, prompt), pooling_type, normalize)


def assert_embedding_matches(ours, reference: torch.Tensor, tolerance: float = 1e-4) -> None:
    """`ours` (floats) equals `reference` within `tolerance` times the reference's norm, element by element."""
    vector = torch.tensor(ours, dtype=torch.float32)
    assert vector.shape == reference.shape, (vector.shape, reference.shape)
    error = float((vector - reference).abs().max() / reference.norm())
    assert error <= tolerance, error
