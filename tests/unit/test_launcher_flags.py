"""Every `vmesh serve` flag reaches the service that owns it: the launcher forwards whole
argument groups, and each service's own parser accepts what it is given."""

from __future__ import annotations

import argparse

import pytest

from vmesh.services.cli import build_parser
from vmesh.services.launcher import NOT_FORWARDED, _flags, group_flags

OWNERS = {"model": ["worker", "detokenizer", "frontend"], "worker": ["worker"], "scheduler": ["scheduler"],
          "frontend": ["frontend"]}


def _sample_value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:  # store_true
        return []
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
        if dest in NOT_FORWARDED:
            continue
        value = _sample_value(_serve_action(dest))
        args = build_parser().parse_args(["serve", option, *value])
        forwarded = _flags(args, group)
        at = forwarded.index(option)
        assert forwarded[at:at + 1 + len(value)] == [option, *value], (option, forwarded)
        for service in OWNERS[group]:
            parsed = build_parser().parse_args([service, *forwarded])
            assert getattr(parsed, dest) == getattr(args, dest), (service, option)


def test_the_flags_that_once_went_missing_are_forwarded():
    args = build_parser().parse_args(["serve", "--no-small-batch-linear", "--max-waiting", "3"])
    assert "--no-small-batch-linear" in _flags(args, "worker")
    scheduler = _flags(args, "scheduler")
    assert scheduler[scheduler.index("--max-waiting") + 1] == "3"


def test_generate_local_honours_or_refuses_every_scheduler_flag():
    from vmesh.services.cli import engine_config

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
