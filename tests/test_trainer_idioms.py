"""Issue 51's rows as real Trainer runs (1 process, GAS=4 x batch 2, one SGD step per window, uneven label counts),
unpatched and patched, on transformers 5.24 (latest) and 5.3 (2026-04, where accelerate divides a normalised loss a
second time):

- the identities real code writes around a division (a chunked sum from a Python 0, Python's ``sum``, an accumulator
  from ``n.new_zeros``, ``n + 1e-8``, ``maximum(n, 1)``, ``where(n > 0, s / n, 0 * s)``, ``nan_to_num``): divided, so
  the reference on both stacks (5.3's 0.25 undone), with nothing said;
- a mean plus ``torch.zeros_like(n)``: independent, so scaled as the mean it is (the reference; 4.0 on 5.24 upstream);
  each micro-batch's token mean over uneven label counts, so the mean of means is said once (issue 53, item 3);
- a value equal to the accumulation steps (issue 58: a coincidence, not a statement): the micro-batch mean divided by
  the steps where the Trainer hands the count (ms-swift's RLHF trainers), the model's loss times the steps, or the model
  handed ``n / steps`` (hand fixes of 5.3's second division, loss weights elsewhere). Each update is upstream's,
  bitwise, on both releases, and one WARNING says what was read and the statement that decides;
- label smoothing on a head the Trainer never hands the count: handed where the release's LabelSmoother takes the
  count (5.24: the smoothed token mean), else upstream's mean of means with one WARNING (5.3);
- a head the Trainer never hands the count (``nokw-llama``) under a ``compute_loss`` override that logs the count or
  adds a z-loss: every step is upstream's mean of means (bitwise on 5.24; 5.3's second division undone, as for any
  mean), the handed first step ran again without the count, and one WARNING says so.

Each unpatched row asserts the factor measured on its stack (tests/test_trainer_scaling.py's tables).
"""
from __future__ import annotations

import pytest

from conftest import uses
from test_trainer_scaling import ENTRY, EXACT, head_factor, measured_unpatched
from zerofix.check import builders
from zerofix.check.scenarios.trainer_gas import IDIOM_ROWS

pytestmark = pytest.mark.distributed
STACKS = ("latest", "2026-04")
LM = {"model": "causal-lm", "gas": 4, "lr": 5.0}
WINDOWS = 2 * 4 * 2  # two optimizer steps: the never-handed rows hold every step, not the first alone


def row_cells(stack: str = "latest") -> list[dict]:
    return ([{**LM, "name": r, "loss": r} for r in IDIOM_ROWS + ("zeros-like-mean", "steps-divided-mean",
                                                                  "times-steps", "count-over-steps")]
            + [{"name": f"nokw-{r}", "model": "nokw-llama", "loss": r, "gas": 4, "lr": 5.0, "samples": WINDOWS,
                "loss_modes": ["batch-mean", "batch-mean"]} for r in ("logged-count", "plus-z-loss")]
            + [{"name": "nokw-vlm-logged-count", "model": "vlm", "loss": "logged-count", "gas": 4, "lr": 5.0,
                "samples": WINDOWS, "loss_modes": ["batch-mean", "batch-mean"]}]
            + [smoothed_cell(stack)])


SMOOTHING = 0.1


def smoothed_cell(stack: str) -> dict:
    """Label smoothing on a head the Trainer never hands the count: 5.24's LabelSmoother takes the count, so zerofix
    hands it and the update is the smoothed token mean; 5.3's takes none, so the mean of means stays, said."""
    patched_mode = "smoothed-token-mean" if stack == "latest" else "smoothed-batch-mean"
    return {"name": "nokw-smoothed", "model": "nokw-llama", "gas": 4, "lr": 5.0, "label_smoothing": SMOOTHING,
            "loss_modes": f"{patched_mode}:{SMOOTHING}", "unpatched_mode": f"smoothed-batch-mean:{SMOOTHING}"}


def rows_requests(stack):
    return [builders.trainer_request(row_cells(stack), nproc=1, name="trainer-idioms")]


def unpatched_factor(stack: str, name: str) -> float:
    mean = head_factor(stack, None, 1, {"model": "causal-lm", "loss": "subclass-mean"})  # 4.0 on 5.24, 1.0 on 5.3
    if name == "zeros-like-mean":
        return mean
    if name == "steps-divided-mean":
        return mean / 4
    normalised = measured_unpatched(stack, "causal-lm", None, 4)  # 1.0 on 5.24, 0.25 on 5.3
    return normalised * 4 if name in ("times-steps", "count-over-steps") else normalised


@pytest.mark.stack(*STACKS)
@uses(rows_requests)
def test_issue_51_rows(ranks, stack):
    results = ranks.result(*rows_requests(stack))
    for cell in row_cells(stack):
        name = cell["name"]
        bug, fixed = results[name]["unpatched"], results[name]["patched"]
        where = f"{name} on {stack}"
        runtime = fixed["rank_runtime"][0][ENTRY][-1]  # this cell's run: the last one the process saw
        print(f"{where}: unpatched {bug['ratio']:.4f}, patched {fixed['ratio']:.4f} ({runtime.get('loss')}; "
              f"{runtime.get('scaled_for_ga') or runtime.get('count_handed') or ''})")
        assert all(s[ENTRY] == "applied" for s in fixed["rank_status"]), (where, fixed["rank_status"])
        if name == "nokw-smoothed":
            as_bug = results[name]["unpatched_as_bug"]
            assert as_bug["ratio"] == pytest.approx(1.0 if stack == "latest" else 0.25, rel=1e-5), (where, as_bug)
            assert fixed["rel_err"] < EXACT, (where, fixed)
            if stack == "latest":  # handed and divided by the smoother: the token mean, nothing to warn of
                assert bug["cosine"] < 0.999 and runtime["steps_divided"] >= 1, (where, bug, runtime)
                assert not runtime.get("warnings"), (where, runtime)
            else:  # the smoother takes no count: upstream's mean of means (its second division undone), said once
                assert runtime.get("warnings") == ["label smoothing: mean of micro-batch means"], (where, runtime)
            continue
        if name.startswith("nokw-"):
            # upstream's mean of means at every step: bitwise on 5.24; on 5.3 its second division undone (4x)
            windows, fixed_windows = bug.get("per_window", [bug]), fixed.get("per_window", [fixed])
            scale = 1.0 if stack == "latest" else 0.25
            assert len(windows) == 2, (where, bug)
            if name != "nokw-plus-z-loss":  # (the z-loss row's own term moves it off the mean of means)
                assert [w["ratio"] for w in windows] == pytest.approx([scale] * 2, rel=1e-5), (where, windows)
                assert [w["ratio"] for w in fixed_windows] == pytest.approx([1.0] * 2, rel=1e-5), (where, fixed)
            if stack == "latest":
                assert fixed["bitwise_as_unpatched"] is True, (where, fixed)
            else:  # the first window from the same weights: 4x; the z-loss's own term keeps its ratio near 1
                assert fixed_windows[0]["ratio"] == pytest.approx(4 * windows[0]["ratio"], rel=1e-5), (where, fixed)
                assert [w["ratio"] for w in fixed_windows] == pytest.approx([1.0] * 2, rel=2e-2), (where, fixed)
            assert "stopped at optimizer step 1" in runtime.get("count_handed", ""), (where, runtime)
            assert runtime.get("count_handed_verdict") == "unknown", (where, runtime)
            assert runtime["corrected"] == (0 if stack == "latest" else 8), (where, runtime)  # 5.3: every backward
            continue
        assert bug["ratio"] == pytest.approx(unpatched_factor(stack, name), rel=1e-4), (where, bug)
        # a token mean of each micro-batch (uneven label counts) that takes no count: the mean of means, said (issue 53)
        means = ["micro-batch mean term: mean of micro-batch means"] if name in ("zeros-like-mean",
                                                                              "steps-divided-mean") else []
        if name in ("steps-divided-mean", "times-steps", "count-over-steps"):  # a coincidence: upstream's update
            assert fixed["bitwise_as_unpatched"] is True and runtime["corrected"] == 0, (where, fixed, runtime)
            assert runtime.get("warnings", []) == ["coincidence: upstream followed"] + means, (where, runtime)
            read = "its last operation divides it by" if name == "steps-divided-mean" else "multiplied by"
            assert read in runtime.get("scaled_for_ga", ""), (where, runtime)
            continue
        assert fixed["rel_err"] < EXACT, (where, fixed)  # the reference
        if unpatched_factor(stack, name) == 1:
            assert fixed["bitwise_as_unpatched"] in (True, None), (where, fixed)
        assert runtime["steps_unknown"] == 0, (where, runtime)
        # a mean zerofix rescales is said once (a user's own division by the steps cannot be told from it: issue 40)
        rescaled = ["rescaled as a mean, unstated"] if name == "zeros-like-mean" and stack == "latest" else []
        assert runtime.get("warnings", []) == rescaled + means, (where, runtime)
        assert ("micro_batch_mean" in runtime) == bool(means), (where, runtime)
        if name in IDIOM_ROWS:
            assert runtime["steps_divided"] >= 1 and "scaled_for_ga" not in runtime, (where, runtime)
        elif name == "zeros-like-mean":
            assert runtime["steps_independent"] >= 1 and "scaled_for_ga" not in runtime, (where, runtime)
