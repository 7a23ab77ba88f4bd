"""Chat for a checkpoint without a template (Gemma 3's GGUF carries none): its architecture's turn
format from the family module, `--chat-template` (a file or the text) in its place at the frontend
and the engine, and the end-of-turn token as a stop through generation_config.json."""

from __future__ import annotations

import json
import shutil

import pytest

from vmesh.services.cli import build_parser
from vmesh.services.cli_commands import _tokenizer_loader
from vmesh.services.common.families.gemma3 import TURNS_TEMPLATE
from vmesh.services.common.model_loading import generation_stop_ids
from vmesh.services.common.tokenizer import ChatTemplateError, TokenizerLoadError, load_chat_tokenizer
from vmesh.services.worker.config import WorkerConfig


@pytest.fixture
def gemma_like_dir(tmp_path, embedded_model_dir):
    """A Gemma 3 config beside a tokenizer without a chat template (the embedded model's vocabulary)."""
    shutil.copy(embedded_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"],
                                                      "model_type": "gemma3_text"}))
    return tmp_path


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " What is 2+2? "}]


def test_gemma3_turns_fold_the_system_message_into_the_first_user_turn(gemma_like_dir):
    tokenizer = load_chat_tokenizer(gemma_like_dir)
    assert tokenizer.chat_template == TURNS_TEMPLATE
    assert tokenizer.render_chat(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert tokenizer.render_chat(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n")
    assert tokenizer.render_chat(CONVERSATION[:1]) == (  # a lone system message still reaches the model
        "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n")


def test_gemma3_turns_refuse_other_roles(gemma_like_dir):
    tokenizer = load_chat_tokenizer(gemma_like_dir)
    with pytest.raises(ChatTemplateError, match="Gemma 3 takes user and assistant turns"):
        tokenizer.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])


def test_a_models_own_template_wins_over_the_familys(gemma_like_dir):
    (gemma_like_dir / "chat_template.jinja").write_text("own: {{ messages[0]['content'] }}")
    assert load_chat_tokenizer(gemma_like_dir).render_chat(CONVERSATION[1:2]) == "own: Hi there"


def test_chat_template_flag_takes_a_file_or_the_text(gemma_like_dir, tmp_path_factory):
    text = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rendered = load_chat_tokenizer(gemma_like_dir, text).render_chat(CONVERSATION[1:3])
    assert rendered == "[user] Hi there\n[assistant] Hello!\n"
    path = tmp_path_factory.mktemp("templates") / "plain.jinja"
    path.write_text("{{ messages | length }} messages")
    assert load_chat_tokenizer(gemma_like_dir, str(path)).render_chat(CONVERSATION) == "4 messages"
    with pytest.raises(TokenizerLoadError, match="'no-such.jinja' is neither a file nor a Jinja template"):
        load_chat_tokenizer(gemma_like_dir, "no-such.jinja")


def test_the_flag_is_one_model_setting_that_reaches_the_frontends_tokenizer(gemma_like_dir):
    """--chat-template is a model-section setting (WorkerConfig): the frontend, the detokenizers and
    the in-process engine all take it; the frontend's tokenizer loader applies it."""
    assert "chat_template" in WorkerConfig.__dataclass_fields__
    args = build_parser().parse_args(["frontend", "--model", str(gemma_like_dir), "--chat-template", "X{{ 1 + 1 }}"])
    assert _tokenizer_loader(args)().render_chat(CONVERSATION) == "X2"
    serve = build_parser().parse_args(["serve", "--chat-template", "T"])
    assert serve.chat_template == "T"


def test_generation_config_stops_join_the_eos_ids(tmp_path):
    assert generation_stop_ids(tmp_path) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert generation_stop_ids(tmp_path) == (1, 106)
