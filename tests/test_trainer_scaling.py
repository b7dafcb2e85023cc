"""The Trainer's gradient-accumulation scaling on every stack: divide exactly once.

Real Trainer under torchrun (gloo, CPU), GAS=8 (one window) and GAS=3 over an epoch of 8 micro-batches
per rank (windows 3, 3 and a short 2), a causal LM taking loss kwargs and a custom module without them,
without DeepSpeed (1 process, 2-rank DDP) and with ZeRO-2/3 (1 and 2 ranks), average_tokens_across_devices
on and off. Every window is compared with the float64 single-process reference computed from the
weights the run had when the window started and from the samples each rank consumed.

Unpatched, each cell asserts what was measured on its stack (a factor, per window), so a wrong version
range or a stack that stopped showing a bug fails here; patched (zerofix.patch(), every entry in range),
every window must equal the reference.
"""
from __future__ import annotations

import pytest

from zerofix.check import parity

EXACT = 1e-6  # relative error of an update, float32 run vs float64 reference
GROUPS = [(None, 1), (None, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
GROUP_IDS = [f"{'zero' + str(s) if s is not None else 'no-deepspeed'}-{n}rank" for s, n in GROUPS]
# the fast tier's smoke: 2 DDP ranks, no DeepSpeed (the path every Trainer/accelerate release crosses)
GROUPS = [pytest.param(*g, marks=pytest.mark.smoke) if g == (None, 2) else g for g in GROUPS]
ALL_STACKS = ("latest", "2026-04", "2025-12", "2025-10", "2025-01", "2024-11")
NEWEST_STACKS = ("latest", "2026-04")
TRAINER_ENTRIES = ("transformers-nokw-undivided", "transformers-deepspeed-double-division",
                   "transformers-accelerate-double-division")
IN_RANGE = {"2024-11": {"transformers-nokw-undivided", "transformers-deepspeed-double-division"},
            "2025-01": {"transformers-deepspeed-double-division"},
            "2026-04": {"transformers-accelerate-double-division"}}
pytestmark = pytest.mark.distributed


def cells(nproc: int) -> list[dict]:
    out = []
    for model in ("causal-lm", "custom"):
        # lr: large, so an update dominates the float32 rounding of weights near 1.0 (norms); 2.0 over three
        # windows, where 5.0 makes the causal LM's third update 35x its first (and rounding 1.6e-6).
        for name, gas, samples, lr in (("gas8", 8, 0, 5.0), ("gas3", 3, 8 * 2 * nproc, 2.0)):
            # average_tokens_across_devices only matters for a loss-kwargs model on several ranks
            for avg in ((True, False) if model == "causal-lm" and nproc > 1 else (True,)):
                out.append({"name": f"{model}-{name}-{'avg' if avg else 'noavg'}", "model": model, "gas": gas,
                            "samples": samples, "average_tokens": avg, "lr": lr})
    return out


def measured_unpatched(stack: str, model: str, stage, gas: int):
    """The update / reference ratio of every window, unpatched, as measured (docs/fixes.md); "last": the
    ZeRO-2 accumulator of deepspeed 0.18.0 keeps each rank's last micro-batch (exact assertion in
    test_deepspeed_backports.py)."""
    deepspeed = stage is not None
    if stack == "2024-11":  # transformers 4.46.3: nobody divides a no-kwargs loss; DeepSpeed divides a normalised one
        if model == "custom":
            return 1.0 if deepspeed else float(gas)
        return 1 / gas if deepspeed else 1.0
    if stack == "2025-01":  # 4.48.3: the Trainer divides (or the model normalises), DeepSpeed again
        return 1 / gas if deepspeed else 1.0
    if stack == "2025-10" and stage == 2:  # deepspeed 0.18.0: deepspeed-zero12-accumulator
        return "last"
    if stack == "2025-12" and deepspeed:  # deepspeed 0.18.3: deepspeed-scale-wrt-gas
        return 1 / gas ** 2 if stage == 2 else 1 / gas  # both models return logits next to the loss
    if stack == "2026-04" and not deepspeed:  # 5.3.0: transformers-accelerate-double-division
        return 1 / gas
    return 1.0


def windows_of(result) -> list[dict]:
    return result.get("per_window", [result])


@pytest.mark.stack(*ALL_STACKS)
@pytest.mark.parametrize("stage, nproc", GROUPS, ids=GROUP_IDS)
def test_trainer_divides_exactly_once(tmp_path, stack, stage, nproc):
    if stage is not None and nproc == 1 and stack not in NEWEST_STACKS:
        pytest.skip("CI time: DeepSpeed with 1 rank runs on the newest stacks; the older ones show their bugs "
                    "with 2 ranks (docs/development.md, 'What runs where')")
    results = parity.trainer_cells(tmp_path, cells(nproc), nproc=nproc, zero_stage=stage)
    for cell in cells(nproc):
        bug, fixed = results[cell["name"]]["unpatched"], results[cell["name"]]["patched"]
        where = f"{cell['name']} zero={stage} ranks={nproc}"
        # The windows the Trainer trains: 4.46-4.48 drop an epoch's short last window (max_steps is
        # floor(micro-batches / GAS)); later releases train it.
        full = [cell["gas"] * nproc] * (3 if cell["gas"] == 3 else 1)
        if cell["gas"] == 3:
            full[-1] = 2 * nproc
            if stack in ("2025-01", "2024-11"):
                full = full[:-1]
        assert bug["windows"] == full and fixed["windows"] == full, (where, bug["windows"], fixed["windows"])

        expected = measured_unpatched(stack, cell["model"], stage, cell["gas"])
        if expected == "last":
            assert bug["rel_err"] > 0.3, (where, bug)
        else:
            for window in windows_of(bug):
                assert window["ratio"] == pytest.approx(expected, rel=1e-4) and window["cosine"] > 1 - 1e-6, \
                    (where, expected, window)
            if expected == 1.0:
                assert bug["rel_err"] < EXACT, (where, bug)
        assert fixed["rel_err"] < EXACT, (where, fixed)

        applied = {i for s in fixed["rank_status"] for i, state in s.items()
                   if i in TRAINER_ENTRIES and state == "applied"}
        assert applied == IN_RANGE.get(stack, set()), (where, applied)
        assert all(s[i] == "not-affected" for s in fixed["rank_status"] for i in TRAINER_ENTRIES
                   if i not in IN_RANGE.get(stack, set())), fixed["rank_status"]


# Per stack, the Trainer paths its entries fix: (ZeRO stage or None, model).
REPATCH_CASES = {"2024-11": [(None, "custom"), (2, "causal-lm")], "2025-01": [(2, "causal-lm")],
                 "2026-04": [(None, "causal-lm")]}


@pytest.mark.stack(*REPATCH_CASES)
def test_trainer_entries_still_match_the_reference_after_patch_unpatch_patch(tmp_path, stack):
    """The orderings of test_orderings.py end in a training step: the Trainer's entries in range are patched,
    unpatched and patched again after transformers is imported, then the Trainer trains (GAS=8, 1 process):
    the update equals the reference, as the patched runs above do."""
    for stage, model in REPATCH_CASES[stack]:
        extra = ["--zero-stage", str(stage)] if stage is not None else []
        result = parity.trainer_gas(tmp_path / f"{model}-{stage}", model=model, zerofix="repatched",
                                    extra_args=extra)["repatched"]
        assert result["rel_err"] < EXACT, (stage, model, result)
        applied = {i for s in result["rank_status"] for i, state in s.items()
                   if i in TRAINER_ENTRIES and state == "applied"}
        assert applied == IN_RANGE[stack], applied
