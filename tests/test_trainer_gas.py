"""transformers-accelerate-double-division, measured with the real Trainer under torchrun (gloo, CPU).

Every cell compares the parameter update with the float64 single-process reference built from the
samples each rank recorded. Unpatched on 2026-04 the tests assert the measured bug (0.125 = 1/GAS), so
a wrong version range or a stack that stopped showing the bug fails here.
"""
from __future__ import annotations

import sys

import pytest

from zerofix.check import parity

FIX = "transformers-accelerate-double-division"
EXACT = 1e-6  # relative error of the update, float32 run vs float64 reference
CELLS = [("causal-lm", 1), ("causal-lm", 2), ("custom", 1), ("custom", 2)]
pytestmark = pytest.mark.distributed


def assert_reference(result, state):
    assert result["rel_err"] < EXACT, result
    assert all(s[FIX] == state for s in result["rank_status"]), result["rank_status"]


@pytest.mark.stack("2026-04")
@pytest.mark.parametrize("model, nproc", CELLS)
def test_double_division_bug_and_fix(tmp_path, model, nproc):
    result = parity.trainer_gas(tmp_path, model=model, nproc=nproc, gas=8)
    bug = result["unpatched"]
    assert bug["ratio"] == pytest.approx(1 / 8, rel=1e-4) and bug["cosine"] > 1 - 1e-9, bug
    assert all(s[FIX] == "inactive" for s in bug["rank_status"])
    assert_reference(result["patched"], "applied")


@pytest.mark.stack("latest")
@pytest.mark.parametrize("model, nproc", CELLS)
def test_not_affected_and_exact_with_and_without_patch(tmp_path, model, nproc):
    result = parity.trainer_gas(tmp_path, model=model, nproc=nproc, gas=8)
    # status() reports the version guard even before patch(): not-affected either way.
    assert_reference(result["unpatched"], "not-affected")
    assert_reference(result["patched"], "not-affected")


ZEROFIX_CLI = [sys.executable, "-m", "zerofix", "run", "--"]


@pytest.mark.parametrize("how", ["ZEROFIX=1", "zerofix run"])
@pytest.mark.stack("2026-04", "latest")
def test_activation_without_code_changes_reaches_every_rank(tmp_path, how, stack):
    """The scenario in ``env`` mode never calls zerofix.patch(); only the environment activates."""
    kwargs = {"env": {"ZEROFIX": "1"}} if how == "ZEROFIX=1" else {"launcher_prefix": ZEROFIX_CLI}
    result = parity.trainer_gas(tmp_path, model="causal-lm", nproc=2, zerofix="env", **kwargs)["env"]
    assert_reference(result, "applied" if stack == "2026-04" else "not-affected")


@pytest.mark.stack("2026-04")
def test_without_activation_env_mode_shows_the_bug(tmp_path):
    result = parity.trainer_gas(tmp_path, model="causal-lm", nproc=2, zerofix="env",
                                env={"ZEROFIX": "0"})["env"]
    assert result["ratio"] == pytest.approx(1 / 8, rel=1e-4)
