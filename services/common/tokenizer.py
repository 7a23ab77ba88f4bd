"""The tokenizer and chat template, loaded without transformers (whose import pulls in torch:
about 4 s and most of a replica's memory). The frontend and the detokenizer need only this;
the worker and the in-process engine keep using transformers.

Reads a model directory's `tokenizer.json` (the `tokenizers` library) and its chat template
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`; where it has none, its
architecture's turn format from services/common/families; `--chat-template` replaces either), rendered the way
transformers renders it: a sandboxed Jinja environment with the special tokens in scope, the
result encoded without adding special tokens again.

Tools (OpenAI's `tools` list) reach the template as its `tools` variable, as transformers passes
them; a template that never references `tools` gets vmesh's built-in tool prompt instead
(services/common/tool_prompt.py), in the format of the tokenizer's `tool_prompt` (Hermes-style
unless the frontend serves another tool-call format)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vmesh.services.common.families import family_of
from vmesh.services.common.families.plan import UnsupportedModelError
from vmesh.services.common.tool_prompt import HERMES_PROMPT, ToolPrompt, prepare_chat

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerLoadError(ValueError):
    pass


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own raise_exception, or a rendering error)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Templates call it as transformers defines it (same parameters, same order)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    serving it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it as a plain class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template reads the `tools` variable (else it would drop the tools silently)."""
    if not chat_template:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(chat_template))
    except jinja2.TemplateError:
        return False


class ChatTokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None, special_tokens: dict[str, str]):
        self.backend_tokenizer = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.supports_tools = template_supports_tools(chat_template)
        self.tool_prompt = HERMES_PROMPT  # the built-in prompt's format (the frontend sets the one it parses)
        self._template = _environment().from_string(chat_template) if chat_template else None

    @classmethod
    def load(cls, model_dir: Path, chat_template: str | None = None) -> ChatTokenizer:
        """chat_template: a template's text (`--chat-template`'s), in place of the model's."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"{model_dir} has no tokenizer.json (vmesh needs a fast tokenizer)")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template = chat_template or template or family_chat_template(model_dir)
        map_path = model_dir / "special_tokens_map.json"  # older checkpoints keep them only there
        token_map = json.loads(map_path.read_text()) if map_path.is_file() else {}
        special = {}
        for name in _SPECIAL:
            value = config.get(name) or token_map.get(name)
            if isinstance(value, dict):  # an AddedToken written out in full
                value = value.get("content")
            if value:
                special[name] = value
        return cls(backend, template, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: int | Sequence[int]) -> str | list[str]:
        """The vocabulary's piece for each id (one id: one piece), as transformers answers."""
        if isinstance(token_ids, int):
            return self.backend_tokenizer.id_to_token(token_ids) or ""
        return [self.backend_tokenizer.id_to_token(t) or "" for t in token_ids]

    @property
    def added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send text or token ids")
        messages, template_tools = prepare_chat(messages, tools, self.supports_tools, self.tool_prompt)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=template_tools, documents=None, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, return_dict: bool = False,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int] | str:
        """transformers' call, for the frontend's use: ids (or the text when tokenize=False)."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """A conversation's prompt as text, the chat template's output, which encode_chat tokenizes
    (without the tokenizer's own special tokens, as transformers' apply_chat_template does)."""
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer.render_chat(messages, add_generation_prompt, tools)
    messages, template_tools = prepare_chat(
        messages, tools, template_supports_tools(getattr(tokenizer, "chat_template", None)))
    extra = {"tools": template_tools} if template_tools else {}
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **extra))


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]],
                tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """A conversation's prompt token ids (by default ready for the assistant's reply): the one call
    every door makes, on a ChatTokenizer or on transformers' tokenizer (same arguments, same ids).
    `tools`: OpenAI's tools list, for the template (or the built-in tool prompt).
    `add_special_tokens`: also the tokenizer's own (a BOS the template may already write)."""
    if isinstance(tokenizer, ChatTokenizer) or add_special_tokens:
        return list(tokenizer.encode(render_chat(tokenizer, messages, tools, add_generation_prompt),
                                     add_special_tokens=add_special_tokens))
    messages, template_tools = prepare_chat(
        messages, tools, template_supports_tools(getattr(tokenizer, "chat_template", None)), tool_prompt_of(tokenizer))
    extra = {"tools": template_tools} if template_tools else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=False, **extra))


def tool_prompt_of(tokenizer: Any) -> ToolPrompt:
    """The built-in tool prompt's format this tokenizer renders (ChatTokenizer's, or one the
    frontend set on transformers' tokenizer)."""
    prompt = getattr(tokenizer, "tool_prompt", None)
    return prompt if isinstance(prompt, ToolPrompt) else HERMES_PROMPT


def chat_template_text(path_or_template: str) -> str:
    """`--chat-template`: a file's contents where it names one, else the text itself when it reads
    as a Jinja template; anything else is most likely a mistyped path."""
    path = Path(path_or_template).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError as exc:
        raise TokenizerLoadError(f"--chat-template: cannot read {path}: {exc}") from exc
    if "{{" in path_or_template or "{%" in path_or_template:
        return path_or_template
    raise TokenizerLoadError(f"--chat-template: {path_or_template!r} is neither a file nor a Jinja template")


def family_chat_template(model_dir: Path) -> str | None:
    """The turn format of the model's architecture (config.json), for a checkpoint without a template."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        names = SimpleNamespace(architectures=config.get("architectures"), model_type=config.get("model_type"))
        return family_of(names).chat_template
    except (OSError, ValueError, AttributeError, UnsupportedModelError):
        return None  # loading the model says what is wrong with its config


def load_chat_tokenizer(model_dir: Path, chat_template: str | None = None) -> Any:
    """ChatTokenizer where the model has a tokenizer.json; otherwise transformers' tokenizer (a
    slow, sentencepiece-only checkpoint), at the price of importing torch. chat_template:
    `--chat-template` (a file or the template itself), in place of the model's own."""
    template = chat_template_text(chat_template) if chat_template else None
    try:
        return ChatTokenizer.load(model_dir, template)
    except TokenizerLoadError as exc:
        import logging

        from vmesh.services.common.model_loading import load_tokenizer

        logging.getLogger(__name__).warning("%s; loading transformers' tokenizer (and torch) instead", exc)
        tokenizer = load_tokenizer(model_dir)
        tokenizer.chat_template = template or tokenizer.chat_template or family_chat_template(model_dir)
        return tokenizer
