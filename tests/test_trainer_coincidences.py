"""Issue 58, item 2, as real Trainer runs (GAS=4 x batch 2, one SGD step, uneven label counts; 1 process, and 2 DDP
ranks where the Trainer's ``loss *= num_processes`` follows the user's loss), unpatched and patched, on transformers
5.24 (latest) and 5.3 (2026-04, whose accelerate divides a normalised loss a second time):

- a value equal to GAS is a coincidence, not a statement: the token mean / GAS through a compute_loss_func
  (ms-swift's RLHF form), ``4.0 * (s / n)`` (a loss weight), a compute_loss override averaging four micro-batch-mean
  terms at GAS 4. Each update is upstream's, bitwise, on both releases (right on one, wrong on the other), with one
  WARNING that says what was read and names the statement that decides;
- a loss divided by both the count and GAS (``s / n / GAS`` through a compute_loss_func, the model's loss / GAS in a
  compute_loss override): said once; the update as before (5.24 upstream's 0.25; 5.3's own second division undone).

Each unpatched row asserts the factor measured on its stack; the plain rule is tests/test_decision.py.
"""
from __future__ import annotations

import pytest

from conftest import uses
from test_trainer_scaling import ENTRY, EXACT, head_factor, measured_unpatched
from zerofix.check import builders

pytestmark = pytest.mark.distributed
STACKS = ("latest", "2026-04")
HELD = ("func-steps-divided-mean", "func-weighted-sum", "func-tensor-weighted-sum", "four-term-mean")
DOUBLE = ("func-steps-divided-sum", "count-and-steps-divided")
TWO_RANKS = ("func-steps-divided-mean", "func-weighted-sum")


def cells(rows) -> list[dict]:
    return [{"name": r, "model": "causal-lm", "loss": r, "gas": 4, "lr": 5.0} for r in rows]


def requests(stack):
    return [builders.trainer_request(cells(HELD + DOUBLE), nproc=1, name="coincidences-1proc"),
            builders.trainer_request(cells(TWO_RANKS), nproc=2, name="coincidences-2rank")]


def unpatched_factor(stack: str, name: str, nproc: int) -> float:
    """Measured unpatched, update / reference (the token mean; the mean of micro-batch means for the mean rows)."""
    normalised = measured_unpatched(stack, "causal-lm", None, 4)  # 1.0 on 5.24, 0.25 on 5.3 (its second division)
    if name == "func-steps-divided-mean":  # a compute_loss_func's mean: 4x (8x on 2 ranks) on 5.24, then / 4
        return head_factor(stack, None, nproc, {"model": "causal-lm", "loss": "func-mean"}) / 4
    if name == "four-term-mean":  # a compute_loss override's mean (no base compute_loss), / 4 by its own average
        return head_factor(stack, None, nproc, {"model": "causal-lm", "loss": "subclass-mean"})
    if name in ("func-weighted-sum", "func-tensor-weighted-sum"):
        return normalised * 4
    return normalised / 4  # the two double divisions


def zerofix_warnings(fixed) -> list[str]:
    return [w for w in fixed["warnings"][0] if w.startswith("zerofix:")]


@pytest.mark.stack(*STACKS)
@uses(requests)
def test_a_value_equal_to_gas_never_moves_an_update(ranks, stack):
    one, two = (ranks.result(r) for r in requests(stack))
    for results, nproc, rows in ((one, 1, HELD + DOUBLE), (two, 2, TWO_RANKS)):
        for name in rows:
            bug, fixed = results[name]["unpatched"], results[name]["patched"]
            where = f"{name} on {stack}, {nproc} process(es)"
            runtime = fixed["rank_runtime"][0][ENTRY][-1]  # this cell's run: the last one the process saw
            said = [w for w in zerofix_warnings(fixed) if "gradient_accumulation_steps (4)" in w]
            print(f"{where}: unpatched {bug['ratio']:.4f}, patched {fixed['ratio']:.4f}; {runtime.get('warnings')}")
            assert bug["ratio"] == pytest.approx(unpatched_factor(stack, name, nproc), rel=1e-4), (where, bug)
            assert len(said) == 1, (where, zerofix_warnings(fixed))  # one WARNING a run, naming the statement
            assert "ZEROFIX_LOSS_IS_SCALED_FOR_GA=1" in said[0], (where, said)
            if name in HELD:  # a coincidence: upstream's update, bitwise, right or not
                assert fixed["bitwise_as_unpatched"] is True, (where, fixed)
                assert "coincidence: upstream followed" in runtime.get("warnings", ()), (where, runtime)
                assert "a coincidence zerofix does not act on" in said[0], (where, said)
                assert runtime["corrected"] == 0, (where, runtime)
            else:  # said once; 5.24: upstream's 0.25, bitwise; 5.3: its second division undone (0.0625 -> 0.25)
                assert fixed["ratio"] == pytest.approx(0.25, rel=1e-4), (where, fixed)
                assert "the count already covers the accumulation window" in said[0], (where, said)
                if stack == "latest":
                    assert fixed["bitwise_as_unpatched"] is True, (where, fixed)
