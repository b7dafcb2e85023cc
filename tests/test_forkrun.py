"""zerofix.check.forkrun, torchrun's stand-in for the tests that launch a program on a few ranks: its usage errors, the
ranks' variables and collectives, and a failing rank stopping the others (the variables themselves are torchrun's:
tests/test_session.py compares them with a torchrun launch's)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from zerofix.check import forkrun

RANKS = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("RANK", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], sys.argv[1:], float(t), flush=True)
"""
FAILS = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 stops here")
dist.barrier()  # never passed: rank 1 is gone
time.sleep(60)
"""


@pytest.mark.parametrize("argv", [[], ["two", "x.py"], ["2"], ["0", "x.py"], ["2", "-m"], ["2", "--import", "torch"],
                                  ["2", "--import"]])
def test_bad_input_exits_with_the_usage(argv):
    with pytest.raises(SystemExit) as raised:
        forkrun.parse(argv)
    assert forkrun.USAGE in str(raised.value)


def test_the_arguments_are_read():
    assert forkrun.parse(["2", "s.py", "--out", "o"]) == (2, (), None, "s.py", ["--out", "o"])
    assert forkrun.parse(["4", "--import", "deepspeed,transformers.trainer", "-m", "pkg.mod", "a"]) == \
        (4, ("deepspeed", "transformers.trainer"), "pkg.mod", None, ["a"])


def launch(tmp_path, code: str, *args) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, "-m", "zerofix.check.forkrun", "2", "--import", "torch", str(script), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.distributed
@pytest.mark.stack_independent
def test_each_rank_runs_the_program_with_its_own_rank(tmp_path):
    proc = launch(tmp_path, RANKS, "--flag", "x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RANK"))
    assert lines == ["RANK 0 0 2 ['--flag', 'x'] 3.0", "RANK 1 1 2 ['--flag', 'x'] 3.0"], proc.stdout


@pytest.mark.distributed
@pytest.mark.stack_independent
def test_a_failing_rank_stops_the_others_and_the_launch_fails(tmp_path):
    began = time.monotonic()
    proc = launch(tmp_path, FAILS)
    assert proc.returncode == 1 and "RuntimeError: rank 1 stops here" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - began < 50  # rank 0 was stopped, not left to its sleep
