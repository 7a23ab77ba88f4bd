"""Settings written once, as dataclass fields, and everything else derived from them: the
command-line flag, its VMESH_<FLAG> environment default (checked as the flag would check it),
the dataclass rebuilt from parsed arguments, and the flags `vmesh serve` forwards to a child.

A field becomes a setting through `setting(default, section=..., ...)`; its section is the
argument group it appears in (model, worker, scheduler, frontend, server, security, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_METADATA_KEY = "vmesh.setting"


class BadEnvironmentValue(ValueError):
    """A VMESH_* variable its flag would refuse."""


@dataclasses.dataclass(frozen=True)
class Setting:
    section: str
    flag: str
    help: str
    choices: tuple[Any, ...] | None
    # Turns the flag's text into the flag's value (argparse `type`); None for a switch.
    parse_flag: Callable[[str], Any] | None
    # Turns the flag's value into the field's (e.g. '2GiB' into bytes); None: the same.
    to_field: Callable[[Any], Any] | None
    # A --no-X switch for a field that is on by default: the field is the switch's negation.
    negated: bool
    # A list field, whose flag is its items comma-separated (`to_field` then maps the list).
    is_list: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return self.parse_flag is None


def setting(default: Any, *, section: str, help: str = "", flag: str | None = None,
            choices: Sequence[Any] | None = None, parse_flag: Callable[[str], Any] | None = None,
            to_field: Callable[[Any], Any] | None = None, negated: bool = False) -> Any:
    """A dataclass field that is also a flag. The flag is --<field-name> unless named; its text is
    parsed as the default's type (int, float, else str) unless `parse_flag` says otherwise; a bool
    field is a switch (store_true), or with `negated` a --no-X switch that turns the field off; a
    list field's flag takes its items comma-separated."""
    is_list = isinstance(default, list)
    if isinstance(default, bool):
        parse_flag = None
    elif parse_flag is None:
        parse_flag = type(default) if isinstance(default, int | float) else str
    spec = {"section": section, "flag": flag, "help": help, "choices": tuple(choices) if choices else None,
            "parse_flag": parse_flag, "to_field": to_field, "negated": negated, "is_list": is_list}
    if is_list:
        items = tuple(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata={_METADATA_KEY: spec})
    return dataclasses.field(default=default, metadata={_METADATA_KEY: spec})


def _default_of(f: dataclasses.Field, spec: Setting) -> Any:
    """The field's default as its flag's default: a list's items comma-separated."""
    if spec.is_list:
        return ",".join(map(str, f.default_factory()))  # type: ignore[operator]  # set by setting() for a list
    return f.default


def settings_of(config_class: type, section: str | None = None) -> Iterator[tuple[dataclasses.Field, Setting]]:
    """(field, its Setting) for each flag-backed field of `config_class`, in declaration order."""
    for f in dataclasses.fields(config_class):
        spec = f.metadata.get(_METADATA_KEY)
        if spec is None or (section is not None and spec["section"] != section):
            continue
        flag = spec["flag"] or "--" + f.name.replace("_", "-")
        yield f, Setting(**{**spec, "flag": flag})


def env_name(flag: str) -> str:
    return "VMESH_" + flag.lstrip("-").upper().replace("-", "_")


def _from_env(env: str, value: str, kwargs: dict[str, Any]) -> object:
    """The value VMESH_<FLAG> sets, checked as the flag itself would check it."""
    if kwargs.get("action") == "store_true":
        if value.lower() not in _TRUE + _FALSE:
            raise BadEnvironmentValue(f"{env}={value!r}: expected one of 1/0, true/false, yes/no, on/off")
        return value.lower() in _TRUE
    try:
        converted = kwargs.get("type", str)(value)
    except ValueError as exc:
        raise BadEnvironmentValue(f"{env}={value!r}: {exc}") from exc
    if kwargs.get("choices") is not None and converted not in kwargs["choices"]:
        raise BadEnvironmentValue(f"{env}={value!r}: choose from {', '.join(map(str, kwargs['choices']))}")
    return converted


def add_option(group: argparse._ActionsContainer, flag: str, **kwargs: Any) -> None:
    """add_argument whose default can be overridden by VMESH_<FLAG>, validated as the flag is."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        kwargs["default"] = _from_env(env, value, kwargs)
    kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
    group.add_argument(flag, **kwargs)


def add_settings(group: argparse._ActionsContainer, config_class: type, section: str,
                 defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None,
                 skip: Collection[str] = ()) -> None:
    """One flag per setting of `config_class` in `section`, but the fields in `skip`. `defaults`
    and `helps` (by field name) are for a command whose default differs, e.g. `vmesh serve`
    turning the HTTP API on."""
    for f, spec in settings_of(config_class, section):
        if f.name in skip:
            continue
        help_text = (helps or {}).get(f.name, spec.help)
        if spec.is_switch:
            add_option(group, spec.flag, action="store_true", help=help_text)
            continue
        kwargs: dict[str, Any] = {"default": (defaults or {}).get(f.name, _default_of(f, spec)), "help": help_text}
        if spec.parse_flag is not str:
            kwargs["type"] = spec.parse_flag
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        add_option(group, spec.flag, **kwargs)


def values_from_args(config_class: type, args: argparse.Namespace, section: str | None = None) -> dict[str, Any]:
    """Field name -> value, from parsed flags: the keyword arguments that rebuild `config_class`."""
    values = {}
    for f, spec in settings_of(config_class, section):
        if not hasattr(args, spec.dest):  # a command without this flag (add_settings' skip): the default
            continue
        value = getattr(args, spec.dest)
        if spec.negated:
            value = not value
        elif spec.is_list:
            value = [item.strip() for item in value.split(",") if item.strip()]
            value = value if spec.to_field is None else spec.to_field(value)
        elif spec.to_field is not None and value is not None:
            value = spec.to_field(value)
        values[f.name] = value
    return values


def section_flags(config_class: type, section: str) -> list[tuple[str, str]]:
    """(--flag, argparse dest) of each setting in one section."""
    return [(spec.flag, spec.dest) for _, spec in settings_of(config_class, section)]


def forwarded_argv(config_class: type, section: str, args: argparse.Namespace,
                   skip: Collection[str] = ()) -> list[str]:
    """The command-line form of every flag of `section` that `args` holds, except dests in
    `skip`: what a child service is given. Unset values (None, a switch left off) are left out,
    so the child's own default, the same definition, applies."""
    argv: list[str] = []
    for flag, dest in section_flags(config_class, section):
        if dest in skip:
            continue
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def json_object_flag(flag: str, text: str, known: Collection[str]) -> dict[str, Any]:
    """A flag whose value is a JSON object (vLLM's --speculative-config, --pooler-config) with
    keys among `known`; anything else is refused with ValueError naming the flag."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return raw
