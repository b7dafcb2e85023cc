"""trl-grpo-window-normalisation (and its GSPO-token copy): GRPO's dapo/cispo/vespo losses, real runs.

torchrun, gloo, CPU, no DeepSpeed, no vLLM: ``GRPOTrainer`` on a tiny random Llama with a Python reward, one
SGD step per case from the same weights (scenario ``zerofix.check.scenarios.trl_grpo``). The reference is
computed by hand in float64 in one process from the inputs every micro-step of every rank received (old
log-probabilities, advantages, masks): the gradient of the window's token-mean of TRL's per-token loss.

- trl 1.6.0 (stack trl160, before the fix): unpatched, update / reference = GAS / steps_per_generation for
  steps_per_generation <, = and > GAS (2, 1, 0.5), on 2 ranks and on 1; patched, equal to the reference within
  1e-6 relative, and where steps_per_generation == GAS identical to the unpatched run (upstream was right).
- trl 1.10.0 and 1.14.2 (fixed in 1.9.2): zerofix's entries are not-affected and the updates equal the reference.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from conftest import uses  # noqa: E402
from zerofix.check import builders, runner  # noqa: E402
from zerofix.check.scenarios import trl_grpo  # noqa: E402

pytestmark = pytest.mark.distributed
SAME = 1e-6  # relative error of the update: float32 training against the float64 reference
ENTRIES = ("trl-grpo-window-normalisation", "trl-gspo-token-window-normalisation")
GAS = 2
CASES = [{"loss_type": "dapo", "spg": spg, "gas": GAS} for spg in (1, 2, 4)] + [
    {"loss_type": "cispo", "spg": 4, "gas": GAS}, {"loss_type": "vespo", "spg": 4, "gas": GAS},
    {"loss_type": "dapo", "spg": 4, "gas": GAS, "trainer": "gspo_token"}]
ONE_RANK = [{"loss_type": "dapo", "spg": 4, "gas": GAS}]


MODEL = "{root}/tiny-llama"  # made by the first run that needs it, in the batch's folder


def grpo_request(cases, *, zerofix, nproc=2):
    args = ["--model-dir", MODEL, "--cases", json.dumps(cases)] + (["--zerofix"] if zerofix else [])
    return runner.Request(name=f"grpo-{'patched' if zerofix else 'unpatched'}-n{nproc}", module=builders.TRL_GRPO,
                          argv=tuple(args), nproc=nproc, timeout=500, imports=("transformers.trainer", "trl"))


def grpo(ranks, cases, *, zerofix, nproc=2):
    """The run's records, and per case its update against the float64 reference."""
    request = grpo_request(cases, zerofix=zerofix, nproc=nproc)
    records = ranks.records(request)
    assert len(records) == nproc
    results = {}
    for case in cases:
        name = trl_grpo.case_name(case)
        for r in records:
            assert "error" not in r["cases"][name], r["cases"][name].get("traceback")
            # every micro-step counts the same tokens: a window's count is GAS/spg of a generation batch's
            assert len(set(r["cases"][name]["completion_tokens"])) == 1
        res = trl_grpo.reference_update(ranks.root / "tiny-llama", sorted(ranks.folder(request).glob(f"{name}-rank*.pt")))
        assert res["rank_spread"] == 0.0  # DDP: every rank holds the same update
        ref, got = res["ref"], res["got"]
        results[name] = {"ratio": float(got @ ref / (ref @ ref)),
                         "rel_err": float((got - ref).norm() / ref.norm()), "got": got,
                         "loss": records[0]["cases"][name]["loss"]}
    return records, results


def both_variants():
    return [grpo_request(CASES, zerofix=z) for z in (False, True)]


def one_rank():
    return [grpo_request(ONE_RANK, zerofix=z, nproc=1) for z in (False, True)]


FIXED_CASES = [CASES[0], CASES[2], CASES[3]]  # spg < GAS, spg > GAS, cispo


def fixed_releases():
    return [grpo_request(FIXED_CASES, zerofix=True)]


@pytest.mark.stack("trl160")
@uses(both_variants)
def test_trl160_updates_are_gas_over_spg_unpatched_and_the_window_mean_patched(ranks):
    gas_over_spg_unpatched_and_the_reference_patched(ranks, CASES, ENTRIES)


# TRL as the frameworks pin it (issue 53): 0.29.1 (ms-swift 4.6, the swift stack) and 0.24.0 (LLaMA-Factory 0.9.5;
# here with transformers 4.57.1, the 2025-10 stack, where its GRPOTrainer imports). Their default loss, dapo.
FRAMEWORK_CASES = [{"loss_type": "dapo", "spg": spg, "gas": GAS} for spg in (1, 2, 4)]


def framework_releases():
    return [grpo_request(FRAMEWORK_CASES, zerofix=z) for z in (False, True)]


@pytest.mark.stack("swift", "2025-10")
@uses(framework_releases)
def test_the_frameworks_trl_releases_are_gas_over_spg_unpatched_and_the_window_mean_patched(ranks):
    gas_over_spg_unpatched_and_the_reference_patched(ranks, FRAMEWORK_CASES, ENTRIES[:1])


def gas_over_spg_unpatched_and_the_reference_patched(ranks, cases, entries):
    records, unpatched = grpo(ranks, cases, zerofix=False)
    assert all(r["status"][e] == "inactive" for r in records for e in entries)
    for case in cases:
        name, factor = trl_grpo.case_name(case), case["gas"] / case["spg"]
        # the update is the intended one scaled by GAS/spg: same direction, measured factor
        assert abs(unpatched[name]["ratio"] - factor) <= 1e-5 * factor, (name, unpatched[name]["ratio"])
        assert unpatched[name]["rel_err"] <= abs(1 - factor) + 1e-5, (name, unpatched[name]["rel_err"])
    records, patched = grpo(ranks, cases, zerofix=True)
    assert all(r["status"][e] == "applied" for r in records for e in entries)
    for case in cases:
        name = trl_grpo.case_name(case)
        assert patched[name]["rel_err"] <= SAME, (name, patched[name]["rel_err"])
    right = trl_grpo.case_name({"loss_type": "dapo", "spg": GAS, "gas": GAS})
    assert bool((patched[right]["got"] == unpatched[right]["got"]).all())  # untouched where upstream is right
    assert patched[right]["loss"] == unpatched[right]["loss"]


@pytest.mark.stack("trl160")
@uses(one_rank)
def test_trl160_one_rank(ranks):
    _, unpatched = grpo(ranks, ONE_RANK, zerofix=False, nproc=1)
    _, patched = grpo(ranks, ONE_RANK, zerofix=True, nproc=1)
    name = trl_grpo.case_name(ONE_RANK[0])
    assert abs(unpatched[name]["ratio"] - 0.5) <= 1e-5 * 0.5, unpatched[name]
    assert patched[name]["rel_err"] <= SAME, patched[name]


@pytest.mark.stack("trl1100", "trl1142")
@uses(fixed_releases)
def test_fixed_releases_are_not_affected_and_equal_the_reference(ranks):
    records, results = grpo(ranks, FIXED_CASES, zerofix=True)
    assert all(r["status"][ENTRIES[0]] == "not-affected" for r in records)
    for name, res in results.items():
        assert res["rel_err"] <= SAME, (name, res["rel_err"])


# Issue 60, item 3: loss_type bnpo normalises each micro-batch by its own completion tokens, by TRL's definition. zerofix
# says so once a run and changes nothing (the scenario's completions all have the same length, so here it also equals
# the window's token mean: the reference).
BNPO = [{"loss_type": "bnpo", "spg": GAS, "gas": GAS}]


def bnpo_runs():
    return [grpo_request(BNPO, zerofix=z) for z in (False, True)]


@pytest.mark.stack("latest", "swift")
@uses(bnpo_runs)
def test_bnpo_is_said_and_left_as_trl_defines_it(ranks):
    _, unpatched = grpo(ranks, BNPO, zerofix=False)
    records, patched = grpo(ranks, BNPO, zerofix=True)
    name = trl_grpo.case_name(BNPO[0])
    assert unpatched[name]["rel_err"] <= SAME and bool((patched[name]["got"] == unpatched[name]["got"]).all())
    scaling = records[0]["cases"][name]["scaling"]
    assert "loss_type bnpo: mean of micro-batch token means (documented)" in scaling.get("warnings", ()), scaling
    assert "averages 4 micro-batch token means" in scaling["local_batch_loss"], scaling  # GAS 2 x 2 ranks
