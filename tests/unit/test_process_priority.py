"""`vmesh serve` lowers the priority of every service but the workers, and a service takes it
from the launcher's word before its threads start."""

from __future__ import annotations

import os
import subprocess
import sys

from vmesh.services.process_priority import NICENESS_ENV, niceness_env


def test_the_workers_keep_the_launcher_s_priority_and_the_others_are_told_to_yield():
    assert niceness_env("worker", 10) == {}
    assert niceness_env("scheduler", 10) == niceness_env("frontend", 10) == {NICENESS_ENV: "10"}
    assert niceness_env("detokenizer", 0) == {}  # 0: everything at the launcher's priority


def test_a_service_takes_the_niceness_for_itself_and_the_threads_it_starts():
    script = ("import os, threading\nfrom vmesh.services.process_priority import NICENESS_ENV, "
              "take_launcher_priority\ntake_launcher_priority()\nseen = []\n"
              "t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
              "t.start(); t.join()\nprint(os.getpriority(os.PRIO_PROCESS, 0), seen[0], NICENESS_ENV in os.environ)")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, NICENESS_ENV: "3"},
                         capture_output=True, text=True, check=True).stdout.split()
    expected = str(min(19, base + 3))
    assert out == [expected, expected, "False"]  # the word is consumed: the service's own children are not told
