"""The torch-free tokenizer the frontend and detokenizers load gives exactly what transformers
gives, on the embedded model: plain text, chat templates, decoding."""

from __future__ import annotations

import pytest

from tests.conftest import CHAT_PROMPTS
from vmesh.services.common.tokenizer import ChatTemplateError, ChatTokenizer

TEXTS = ["Hello!", "  leading spaces and ünïcödé — 你好 🙂", "<|im_start|>user\nhi<|im_end|>", "a" * 300, ""]


@pytest.fixture(scope="module")
def lean(embedded_model_dir) -> ChatTokenizer:
    return ChatTokenizer.load(embedded_model_dir)


def test_text_encodes_as_transformers_does(lean, embedded_tokenizer):
    for text in TEXTS:
        assert lean.encode(text) == embedded_tokenizer.encode(text), text


def test_chat_templates_render_as_transformers_does(lean, embedded_tokenizer):
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    conversations += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = embedded_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                              tokenize=True, return_dict=False)
            assert lean.apply_chat_template(messages, add_generation_prompt=generation_prompt) == list(expected)


def test_decoding_matches(lean, embedded_tokenizer):
    ids = embedded_tokenizer.encode(TEXTS[1]) + embedded_tokenizer.encode(TEXTS[2])
    for skip in (True, False):
        assert lean.decode(ids, skip_special_tokens=skip) == embedded_tokenizer.decode(ids, skip_special_tokens=skip)
    assert lean.convert_ids_to_tokens(ids) == embedded_tokenizer.convert_ids_to_tokens(ids)
    assert lean.convert_ids_to_tokens(ids[0]) == embedded_tokenizer.convert_ids_to_tokens(ids[0])
    assert set(lean.added_tokens_decoder) == set(embedded_tokenizer.added_tokens_decoder)


def test_a_template_error_is_a_chat_template_error(lean):
    broken = ChatTokenizer(lean.backend_tokenizer, "{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer(lean.backend_tokenizer, None, {}).apply_chat_template([{"role": "user", "content": "x"}])


def test_templates_using_transformers_extensions_render(lean):
    template = ("{% for m in messages %}{% generation %}{{ m.content | tojson(separators=(',', ':')) }}"
                "{% endgeneration %}{% endfor %}{{ bos_token }}")
    tokenizer = ChatTokenizer(lean.backend_tokenizer, template, {"bos_token": "<s>"})
    assert tokenizer.render_chat([{"role": "user", "content": {"a": [1, 2]}}]) == '{"a":[1,2]}<s>'


def test_special_tokens_come_from_the_older_map_file_too(tmp_path, embedded_model_dir):
    import json
    import shutil

    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(embedded_model_dir / name, tmp_path / name)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<|im_start|>"}}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTokenizer.load(tmp_path).special_tokens["bos_token"] == "<|im_start|>"


def test_a_model_without_tokenizer_json_falls_back_to_transformers(tmp_path, embedded_model_dir):
    from vmesh.services.common.tokenizer import TokenizerLoadError, load_chat_tokenizer

    with pytest.raises(TokenizerLoadError):
        ChatTokenizer.load(tmp_path)
    with pytest.raises(Exception, match=str(tmp_path)):  # transformers' own refusal, not ours
        load_chat_tokenizer(tmp_path)
