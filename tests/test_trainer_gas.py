"""Activation without code changes (ZEROFIX=1, zerofix run) reaches every rank of a real Trainer job.

The scenario in ``env`` mode never calls zerofix.patch(). The environment must apply
transformers-trainer-scaling on both stacks (on 2026-04 its absence shows transformers 5.3's double division of a
causal LM's loss, 0.125 = 1/GAS; on latest the causal LM is right either way and the entry changes nothing
there). The scaling itself, stack by stack and head by head, is in test_trainer_scaling.py.
"""
from __future__ import annotations

import sys

import pytest

from zerofix.check import builders

FIX = "transformers-trainer-scaling"
EXACT = 1e-6  # relative error of the update, float32 run vs float64 reference
pytestmark = pytest.mark.distributed


def assert_reference(result, state):
    assert result["rel_err"] < EXACT, result
    assert all(s[FIX] == state for s in result["rank_status"]), result["rank_status"]


ZEROFIX_CLI = [sys.executable, "-m", "zerofix", "run", "--"]


@pytest.mark.parametrize("how", ["ZEROFIX=1", "zerofix run"])  # the full tier's (11 s: the fast tier's time, issue 68)
@pytest.mark.stack("2026-04", "latest")
def test_activation_without_code_changes_reaches_every_rank(tmp_path, how, stack):
    """The scenario in ``env`` mode never calls zerofix.patch(); only the environment activates."""
    kwargs = {"env": {"ZEROFIX": "1"}} if how == "ZEROFIX=1" else {"launcher_prefix": ZEROFIX_CLI}
    result = builders.trainer_gas(tmp_path, model="causal-lm", nproc=2, zerofix="env", **kwargs)["env"]
    assert_reference(result, "applied")


@pytest.mark.stack("2026-04")
def test_without_activation_env_mode_shows_the_bug(tmp_path):
    result = builders.trainer_gas(tmp_path, model="causal-lm", nproc=2, zerofix="env",
                                env={"ZEROFIX": "0"})["env"]
    assert result["ratio"] == pytest.approx(1 / 8, rel=1e-4)
