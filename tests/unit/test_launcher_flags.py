"""Every `vmesh serve` flag reaches the service that owns it: the launcher forwards whole
argument groups, each service's own parser accepts what it is given, and the settings the
service builds from it hold the value given to `vmesh serve`."""

from __future__ import annotations

import argparse

import pytest

from vmesh.services.cli import build_parser
from vmesh.services.cli_commands import engine_config, worker_config
from vmesh.services.common.config_flags import settings_of, values_from_args
from vmesh.services.flag_groups import SECRET_SETTINGS, SETTINGS_GROUPS, forwarded_flags, forwarded_secrets, group_flags
from vmesh.services.frontend.settings import FrontendSettings
from vmesh.services.scheduler.settings import SchedulerSettings
from vmesh.services.worker.config import WorkerConfig

OWNERS = {"model": ["worker", "detokenizer", "frontend"], "worker": ["worker"], "scheduler": ["scheduler"],
          "frontend": ["frontend"]}


def _settings_built_by(service: str, group: str, args: argparse.Namespace) -> dict[str, object]:
    """Flag dest -> the field's value in the settings `service` builds from its parsed flags."""
    if service == "worker":
        built = worker_config(args)
    elif service == "scheduler":
        built = SchedulerSettings(**values_from_args(SchedulerSettings, args))
    elif service == "frontend" and group == "frontend":
        built = FrontendSettings(**values_from_args(FrontendSettings, args))
    else:  # the model section, which the detokenizers and the frontend read for the tokenizer
        built = WorkerConfig(**values_from_args(WorkerConfig, args, "model"))
    return {spec.dest: getattr(built, f.name) for f, spec in settings_of(SETTINGS_GROUPS[group], group)}


SAMPLE_TEXT = {"kv_cache_memory": "2GiB",  # flags whose text the service parses further
               "speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}',
               "pooler_config": '{"pooling_type": "MEAN", "normalize": false}'}


def _sample_value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:  # store_true
        return []
    if action.dest in SAMPLE_TEXT:
        return [SAMPLE_TEXT[action.dest]]
    if action.choices:
        return [str(list(action.choices)[-1])]
    if action.type is int:
        return ["7"]
    if action.type is float:
        return ["0.5"]
    return ["x"]


def _serve_action(dest: str) -> argparse.Action:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return next(a for a in serve._actions if a.dest == dest)


@pytest.mark.parametrize("group", sorted(OWNERS))
def test_each_serve_flag_is_forwarded_to_a_service_that_accepts_it(group):
    flags = group_flags(group)
    assert flags, group
    for option, dest in flags:
        if dest in SECRET_SETTINGS:  # by environment (test_a_secret_is_forwarded_by_environment_only)
            continue
        value = _sample_value(_serve_action(dest))
        args = build_parser().parse_args(["serve", option, *value])
        forwarded = forwarded_flags(args, group)
        at = forwarded.index(option)
        assert forwarded[at:at + 1 + len(value)] == [option, *value], (option, forwarded)
        for service in OWNERS[group]:
            parsed = build_parser().parse_args([service, *forwarded])
            assert getattr(parsed, dest) == getattr(args, dest), (service, option)
            built = _settings_built_by(service, group, parsed)[dest]
            assert built == _settings_built_by(service, group, args)[dest], (service, option)


def test_the_flags_that_once_went_missing_are_forwarded():
    args = build_parser().parse_args(["serve", "--no-small-batch-linear", "--max-waiting", "3"])
    assert "--no-small-batch-linear" in forwarded_flags(args, "worker")
    scheduler = forwarded_flags(args, "scheduler")
    assert scheduler[scheduler.index("--max-waiting") + 1] == "3"


def test_a_secret_is_forwarded_by_environment_only():
    """`ps` shows every user a process's argv: the API key reaches the frontend as VMESH_API_KEY."""
    args = build_parser().parse_args(["serve", "--api-key", "k"])
    assert "--api-key" not in forwarded_flags(args, "frontend") and "k" not in forwarded_flags(args, "frontend")
    assert forwarded_secrets(args, "frontend") == {"VMESH_API_KEY": "k"}


def test_generate_local_honours_or_refuses_every_scheduler_flag():
    config = engine_config(build_parser().parse_args(["generate", "hi", "--local", "--max-waiting", "5"]))
    assert config.max_waiting == 5
    with pytest.raises(ValueError, match="stateless-worker"):
        engine_config(build_parser().parse_args(["generate", "hi", "--local", "--stateless-worker"]))


def test_every_serve_argument_group_is_forwarded_or_the_launcher_s_own():
    """A group added to `vmesh serve` must be given to its services (OWNERS) or be one the
    launcher itself reads; otherwise its flags would silently do nothing."""
    launcher_own = {"positional arguments", "options", "server"}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    titles = {g.title for g in serve._action_groups}
    assert titles - launcher_own == set(OWNERS), titles


def test_serve_takes_only_the_server_flags_the_launcher_reads(capsys):
    """Its "server" group is the launcher's own: where the public port listens and the ready
    file. A service's --metrics-port would do nothing there (--metrics gives each service one),
    so it is refused rather than dropped."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    server = next(g for g in serve._action_groups if g.title == "server")
    assert {a.dest for a in server._group_actions} == {"host", "port", "ready_file"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-port", "9100"])
    assert "unrecognized arguments: --metrics-port" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--metrics"]).metrics


@pytest.mark.parametrize("group", sorted(OWNERS))
def test_each_forwarded_group_is_exactly_its_settings_dataclass(group):
    """No flag is added to a forwarded group by hand: the launcher forwards what the dataclass
    defines, so a hand-made flag would be parsed by `vmesh serve` and never reach its service."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    titled = next(g for g in serve._action_groups if g.title == group)
    assert [(a.option_strings[0], a.dest) for a in titled._group_actions] == group_flags(group)


@pytest.mark.parametrize(("command", "build", "expected"), [
    (["worker"], worker_config, WorkerConfig()),
    (["scheduler"], lambda a: SchedulerSettings(**values_from_args(SchedulerSettings, a)), SchedulerSettings()),
    (["frontend"], lambda a: FrontendSettings(**values_from_args(FrontendSettings, a)), FrontendSettings()),
])
def test_an_unset_flag_leaves_the_dataclass_default(monkeypatch, command, build, expected):
    for variable in [v for v in __import__("os").environ if v.startswith("VMESH_")]:
        monkeypatch.delenv(variable)
    assert build(build_parser().parse_args(command)) == expected


def test_the_engine_takes_the_scheduler_settings_of_the_command_line():
    config = engine_config(build_parser().parse_args(["generate", "hi", "--local"]))
    assert {f.name: getattr(config, f.name) for f, _ in settings_of(SchedulerSettings)} == \
        {f.name: getattr(SchedulerSettings(), f.name) for f, _ in settings_of(SchedulerSettings)}
    assert config.worker == WorkerConfig()
