"""The CLI's manners: one clear line and a non-zero exit where a user made a mistake or no
server answers, and every VMESH_* variable checked as its flag would be."""

from __future__ import annotations

import socket

import pytest

from vmesh.services.cli import main


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_without_a_server_prints_one_line(capsys):
    code = main(["--log-level", "ERROR", "generate", "hi", "--address", f"127.0.0.1:{closed_port()}"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1 and "UNAVAILABLE" in err and "Traceback" not in err


@pytest.mark.parametrize(("variable", "value", "named"), [
    ("VMESH_DTYPE", "float99", "choose from"),
    ("VMESH_MAX_NUM_SEQS", "lots", "invalid literal"),
    ("VMESH_NO_PREFIX_CACHING", "ture", "true/false"),
    ("VMESH_PIPELINE_DEPTH", "3", "choose from"),
])
def test_a_bad_environment_value_is_refused_like_a_bad_flag(monkeypatch, capsys, variable, value, named):
    monkeypatch.setenv(variable, value)
    assert main(["worker", "--help"]) == 2
    err = capsys.readouterr().err
    assert variable in err and named in err


def test_good_environment_values_still_apply(monkeypatch):
    from vmesh.services.cli import build_parser

    monkeypatch.setenv("VMESH_NO_PREFIX_CACHING", "yes")
    monkeypatch.setenv("VMESH_PIPELINE_DEPTH", "1")
    args = build_parser().parse_args(["scheduler"])
    assert args.no_prefix_caching is True and args.pipeline_depth == 1


def test_bench_after_a_global_log_level_and_an_unknown_backend_is_one_clear_error():
    with pytest.raises(SystemExit, match="unknown --backend gprc"):
        main(["--log-level", "INFO", "bench", "serving", "--backend", "gprc"])
