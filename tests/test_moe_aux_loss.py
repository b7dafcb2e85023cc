"""transformers-moe-aux-loss (issue 40, item 3): a Mixtral causal LM (output_router_logits, router_aux_loss_coef
0.5) under the Trainer, GAS=4 x batch 2, one SGD step: patched, the float64 reference (the cross-entropy over the
window's tokens plus the coefficient times the auxiliary loss averaged over the window's micro-batches of every
rank); unpatched, exactly the mis-weighting measured on the stack, asserted as its own reference (``moe:<c>:<a>``:
the cross-entropy times c, the auxiliary term times a), so a release that changes how it weights either term fails
here.

Measured (1e-7 against those references): transformers 5.23 / 5.0 / 4.57 / 4.48 / 4.46, 1 process: the auxiliary term
x4 (GAS),
2 DDP processes with average_tokens_across_devices: x8 (GAS x processes), through DeepSpeed ZeRO-2: x8; 5.3 (accelerate
divides again): the cross-entropy x0.25 and the auxiliary term right on 1 process (x2 on 2), so there the Trainer
entry restores the cross-entropy and this entry keeps the auxiliary term where it was.
"""
from __future__ import annotations

import pytest

from conftest import uses
from test_trainer_scaling import EXACT
from zerofix.check import builders

pytestmark = pytest.mark.distributed
ENTRY = "transformers-moe-aux-loss"
STACKS = ("latest", "2026-04", "2025-12", "2025-10", "2025-01", "2024-11")
# transformers 4.46 / 4.48: average_tokens_across_devices is off by default (each rank normalises by its own tokens,
# which the moe reference does not model yet) and DeepSpeed divides again (#35808): one process there. 5.0 and 4.57
# weight the terms as 5.23 does (measured, 2 ranks and ZeRO-2 too): one process there as well, for CI time.
ONE_PROCESS_ONLY = ("2025-12", "2025-10", "2025-01", "2024-11")
# (stack, path) -> the unpatched run's weights (cross-entropy, auxiliary term), per number of processes
UNPATCHED = {
    ("2026-04", "nods"): {1: "moe:0.25:1", 2: "moe:0.25:2"},
    ("2026-04", "zero2"): {2: "moe:1:8"},
    # DeepSpeed's own bugs of these releases change the unpatched update too (deepspeed-scale-wrt-gas on 0.18.3,
    # deepspeed-zero12-accumulator on 0.18.0): only its being wrong is asserted there
    ("2025-12", "zero2"): {2: None},
    ("2025-10", "zero2"): {2: None},
}
DEFAULT = {"nods": {1: "moe:1:4", 2: "moe:1:8"}, "zero2": {2: "moe:1:8"}, "zero3": {1: "moe:1:4"},
           "fsdp2-bf16": {1: None}}
GROUPS = [(None, 1), (None, 2), (2, 2), (3, 1), ("fsdp2-bf16", 1)]
# Where the model's output carries a copy of the auxiliary loss the loss was computed from (found on an H100, then
# here): ZeRO-3 wraps every module output in an identity function; accelerate casts FSDP2's bf16 outputs to float32.
# On the two newest stacks (CI time); FSDP2 needs accelerate >= 1.10 anyway.
COPIED_OUTPUT_STACKS = ("latest", "2026-04")
BF16_BOUND = 0.1  # a bf16 router against float64: 0.04 patched here (routing and softmax in bf16); the bug: > 1


def cell(stack: str, stage, nproc: int) -> dict:
    path = "nods" if stage is None else stage if isinstance(stage, str) else f"zero{stage}"
    mode = UNPATCHED.get((stack, path), DEFAULT[path])[nproc]
    return {"name": "moe", "model": "moe", "gas": 4, "lr": 2.0, "unpatched_mode": mode,
            **({"bf16": True} if path.endswith("bf16") else {})}


def moe_requests(stack, stage, nproc):
    if stack in ONE_PROCESS_ONLY and (stage, nproc) != (None, 1):
        return []
    if stage in (3, "fsdp2-bf16") and stack not in COPIED_OUTPUT_STACKS:
        return []
    fsdp = {"fsdp": 2} if stage == "fsdp2-bf16" else {"zero_stage": stage}
    return [builders.trainer_request([cell(stack, stage, nproc)], nproc=nproc, name="trainer-moe", **fsdp)]


@pytest.mark.stack(*STACKS)
@pytest.mark.parametrize("stage, nproc", GROUPS, ids=["no-deepspeed-1rank", "no-deepspeed-2rank", "zero2-2rank",
                                                      "zero3-1rank", "fsdp2-bf16-1rank"])
@uses(moe_requests)
def test_the_router_aux_loss_is_weighted_as_in_one_big_batch(ranks, stack, stage, nproc):
    if not moe_requests(stack, stage, nproc):
        pytest.skip("not on this stack (see ONE_PROCESS_ONLY, COPIED_OUTPUT_STACKS)")
    result = ranks.result(*moe_requests(stack, stage, nproc))["moe"]
    where = f"moe {stage} ranks={nproc} on {stack}"
    mode, fixed = cell(stack, stage, nproc)["unpatched_mode"], result["patched"]
    if mode is not None:
        # the bug, to float32 rounding of its extra multiply and divide (1.7e-6 on 2026-04, 2 ranks)
        assert result["unpatched_as_bug"]["rel_err"] < 1e-5, (where, mode, result["unpatched_as_bug"])
    assert result["unpatched"]["rel_err"] > 0.1, (where, result["unpatched"])  # and it is wrong
    assert fixed["rel_err"] < (BF16_BOUND if stage == "fsdp2-bf16" else EXACT), (where, fixed)
    assert all(s[ENTRY] == "applied" for s in fixed["rank_status"]), (where, fixed["rank_status"])
    runtime = fixed["rank_runtime"][0][ENTRY]
    assert runtime and runtime[-1]["reweighted"] == runtime[-1]["backwards"] == 4, (where, runtime)
