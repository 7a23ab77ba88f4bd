"""The shipped workloads, tokenized for another model than the embedded one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmesh.services.bench.common import for_model, load_workload
from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.common.tokenizer import load_chat_tokenizer


@pytest.mark.parametrize("name", ["standard", "overlap"])
def test_tokenizing_a_workload_s_text_again_gives_its_shipped_ids(name: str, tmp_path: Path) -> None:
    """Told the embedded model is another one, the workload is tokenized from its text by that
    model's tokenizer into a file the peers read: the embedded tokenizer must give back the ids
    the workload ships."""
    embedded = resolve_model_dir()
    shipped = load_workload(name, 8, None)
    work = for_model(shipped, embedded, tmp_path / "not-the-embedded-model", tmp_path)
    assert work["path"] != shipped["path"] and work["path"].parent == tmp_path
    assert work["prompts"] == shipped["prompts"] and work["latency_prompt"] == shipped["latency_prompt"]
    written = json.loads(work["path"].read_text())
    assert written["n_requests"] == 8 and written["prompt_token_ids"] == shipped["prompts"]


def test_the_embedded_model_reads_the_shipped_file(tmp_path: Path) -> None:
    embedded = resolve_model_dir()
    shipped = load_workload("standard", None, None)
    assert for_model(shipped, embedded, embedded, tmp_path) is shipped


def test_a_workload_of_ids_only_cannot_serve_another_model(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="token ids only"):
        for_model(load_workload("long", 2, None), resolve_model_dir(), tmp_path / "other", tmp_path)


def test_every_overlap_passage_outlasts_the_fixed_output_length() -> None:
    """A faithful answer must still be inside its passage at the last of its max_new_tokens
    (EOS is ignored): a shorter passage would fill the rest with whatever the model makes up
    after its EOS, which is not text that repeats the prompt."""
    workload = json.loads(load_workload("overlap", None, None)["path"].read_text())
    tokenizer = load_chat_tokenizer(resolve_model_dir())
    assert workload["ignore_eos"] and workload["latency_prompt"] in workload["prompts"]
    for prompt in workload["prompts"]:
        user_turn = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        passage = user_turn.split("\n\n", 1)[1]
        assert len(tokenizer.encode(passage, add_special_tokens=False)) > workload["max_new_tokens"], passage[:40]


def test_the_offline_help_names_every_baseline():
    """`vmesh bench offline --help` is where a user finds the variants: each one is named there."""
    import re

    from vmesh.services.bench.cli import build_parser
    from vmesh.services.bench.offline import ENGINE_VARIANTS, FINAL_OUTPUTS, MESH_VARIANTS
    from vmesh.services.bench.peers import PEER_BASELINES

    offline = build_parser()._subparsers._group_actions[0].choices["offline"]  # type: ignore[union-attr]
    [baselines] = [action.help for action in offline._actions if action.dest == "baselines"]
    named = set(re.findall(r"[a-z0-9.]+(?:-[a-z0-9.]+)*", baselines))
    for name in ["transformers", *ENGINE_VARIANTS, *MESH_VARIANTS, FINAL_OUTPUTS, *PEER_BASELINES]:
        assert name in named, name
