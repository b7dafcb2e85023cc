"""transformers-trainer-scaling under TRL's trainers that compute their own loss (real runs, 2 ranks, gloo).

GKDTrainer (``lmbda=0``): trl 1.5.1's loss is the micro-batch mean of the generalized JSD over counted tokens
and ignores ``num_items_in_batch`` (measured: it never reads it), which transformers 5.3 happens to scale right
(accelerate's second division is the one a mean needs); trl 1.16's loss is normalised by ``num_items_in_batch``
(it reads it), right on 5.23. RewardTrainer states what its loss is (``loss_is_scaled_for_ga = False`` on trl 1.16;
``model_accepts_loss_kwargs = False`` on trl 1.5.1), so zerofix has nothing to measure; transformers 5.3 divides
it twice (0.25).

For each, one SGD step at GAS=4 (2 samples per micro-batch) against the reference, the same Trainer at GAS=1
with the window's 8 samples in one micro-batch (every sample counts the same tokens: the means agree), unpatched
then patched in the same ranks (zerofix.trl_trainers' docstring). Measured, update / reference:

| stack (transformers, trl) | GKD unpatched | GKD patched | Reward unpatched | Reward patched |
|---|---|---|---|---|
| latest (5.23.0, 1.16.0) | 1.0 | 1.0, bitwise | 1.0 | 1.0, bitwise |
| 2026-04 (5.3.0, 1.5.1) | 1.0 (before issue 29 zerofix made it 4.0) | 1.0, bitwise | 0.25 | 1.0 |

(1 process and 2 ranks alike; the test runs 2.)
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")

from conftest import uses  # noqa: E402
from zerofix.check import reference, runner  # noqa: E402

pytestmark = pytest.mark.distributed
EXACT = 1e-5  # relative error of one SGD update, GAS=4 against one micro-batch of 8 (float32 both)
MEASURED = {"latest": {"gkd": 1.0, "reward": 1.0}, "2026-04": {"gkd": 1.0, "reward": 0.25}}


def trainers():
    """GKD and Reward, unpatched then patched, in one run (student and teacher made by the run, in the batch's
    folder)."""
    return [runner.Request(name="trl-trainers", module="zerofix.check.scenarios.trl_trainers", nproc=2, timeout=600,
                           argv=("--student", "{root}/trl-trainers/student", "--teacher", "{root}/trl-trainers/teacher"),
                           imports=("transformers.trainer", "trl"))]


@pytest.mark.stack(*MEASURED)
@uses(trainers)
def test_trl_trainers_are_scaled_by_what_their_loss_does(ranks, stack):
    import torch

    (request,) = trainers()
    records = ranks.records(request)
    assert all("error" not in r for r in records), [r.get("traceback") for r in records]
    out = ranks.folder(request)
    for name, unpatched_factor in MEASURED[stack].items():
        init = torch.load(out / f"{name}-init.pt")
        runs = {v: {r: torch.load(out / f"{name}-{v}-{r}.pt") for r in ("gas4", "whole")}
                for v in ("unpatched", "patched")}
        # the reference runs (one micro-batch per window) are the same with and without zerofix: GAS=1
        assert all(torch.equal(runs["unpatched"]["whole"][k], runs["patched"]["whole"][k]) for k in init), name
        bug = reference.compare(init, runs["unpatched"]["gas4"], runs["unpatched"]["whole"])
        fixed = reference.compare(init, runs["patched"]["gas4"], runs["unpatched"]["whole"])
        assert bug["ratio"] == pytest.approx(unpatched_factor, rel=1e-3) and bug["cosine"] > 1 - 1e-5, (name, bug)
        assert fixed["rel_err"] < EXACT, (name, fixed)
        if unpatched_factor == 1.0:  # right upstream: left alone, bitwise
            assert all(torch.equal(runs["unpatched"]["gas4"][k], runs["patched"]["gas4"][k]) for k in init), name
        details = records[0][f"{name}-patched-gas4"]["runtime"]
        assert details and bool(details[-1]["corrected"]) == (unpatched_factor != 1.0), (name, details)
