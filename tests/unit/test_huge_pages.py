"""Importing vmesh leaves the environment alone; the `vmesh` command (every service's entry, and
the launcher's, whose children inherit it) asks torch for huge pages before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.checkout import ROOT
from vmesh.services.common.huge_pages import VARIABLE

RUN_THE_COMMAND = f"""
import os, sys
from vmesh.services.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
print(os.environ.get("{VARIABLE}"), "torch" in sys.modules)
"""


def python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != VARIABLE}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, check=True, timeout=120).stdout.splitlines()[-1]


def test_importing_vmesh_changes_no_environment_variable():
    code = ("import os; before = dict(os.environ)\n"
            "import vmesh, vmesh.services, vmesh.services.cli, vmesh.kernels\n"
            "print(before == dict(os.environ))")
    assert python(code) == "True"


def test_the_vmesh_command_prefers_huge_pages_before_torch_loads():
    assert python(RUN_THE_COMMAND) == "1 False"
    assert python(RUN_THE_COMMAND, **{VARIABLE: "0"}) == "0 False"  # the operator's choice stands
