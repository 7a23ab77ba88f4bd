"""`vmesh bench online`'s loads and its refusal without the peers' vLLM environment (the run
itself needs that environment, which CI does not build)."""
from __future__ import annotations

import math

import pytest

from vmesh.services.bench.cli import main
from vmesh.services.bench.online_peers import Load, parse_variants


def test_loads_become_the_clients_flags():
    assert Load.parse("burst:32") == Load("burst:32", math.inf, 32)
    assert Load.parse("burst:32").client_flags() == ["--request-rate", "inf", "--max-concurrency", "32"]
    assert Load.parse("rate:2").client_flags() == ["--request-rate", "2.0"]


@pytest.mark.parametrize("text", ["burst", "burst:x", "rate:fast", "poisson:2"])
def test_a_load_that_is_neither_form_is_refused_by_name(text):
    with pytest.raises(SystemExit, match=f"--loads: '{text}'"):
        Load.parse(text)


def test_without_the_peers_environment_it_says_how_to_build_it(tmp_path):
    with pytest.raises(SystemExit, match="benchmarks/peers/setup.sh"):
        main(["online", "--peers-dir", str(tmp_path), "--out", str(tmp_path)])


def test_variants_are_named_vmesh_servers_with_their_flags():
    assert parse_variants(["nocap=--max-prefill-tokens-with-decodes 0", "plain=--service-niceness 0"]) == {
        "nocap": ["--max-prefill-tokens-with-decodes", "0"], "plain": ["--service-niceness", "0"]}


@pytest.mark.parametrize("text", ["nocap", "=--x", "vllm=--x", "vmesh=--x"])
def test_a_variant_without_a_new_name_is_refused(text):
    with pytest.raises(SystemExit, match=f"--variant: '{text}'"):
        parse_variants([text])
