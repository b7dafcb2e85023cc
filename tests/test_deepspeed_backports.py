"""deepspeed-zero12-accumulator (0.17.6-0.18.2) and deepspeed-scale-wrt-gas (0.18.3): DeepSpeed's own
fixes of 0.18.3 and 0.18.4, backported, measured with the real Trainer under torchrun (gloo, CPU).

Every run is compared with the float64 single-process reference built from the samples each rank
recorded. Unpatched, the tests assert the bug as measured on its stack (so a wrong version range, or a
stack that stops showing it, fails here); patched, the update must equal the reference. DeepSpeed's own
loop (backward + step per micro-batch, config GAS=4) is measured cell by cell in
test_deepspeed_accumulation.py, where both fixes are applied together with deepspeed-manual-accumulation.
"""
from __future__ import annotations

import json
from importlib import metadata

import pytest

from conftest import run_python, uses
from zerofix import catalogue, versions
from zerofix.check import builders

ACCUMULATOR = "deepspeed-zero12-accumulator"
OFFLOAD = "deepspeed-offload-accumulator"
SCALE = "deepspeed-scale-wrt-gas"
HOOK = "deepspeed-output-hook-division"
EXACT = 1e-6  # relative error of the update, float32 run vs float64 reference
CELLS = [(stage, model, nproc) for stage in (2, 3) for model in ("causal-lm", "custom") for nproc in (1, 2)]
CELL_IDS = [f"zero{s}-{m}-{n}rank" for s, m, n in CELLS]

# Trainer, GAS=8, deepspeed 0.18.0 / transformers 4.57.1, ZeRO-2, unpatched: (ratio, cosine) against the
# reference. The values depend on the data; what they mean is asserted exactly through ``vs_last``.
MEASURED_LAST = {("causal-lm", 1): (0.1389, 0.3746), ("causal-lm", 2): (0.1630, 0.4085),
                 ("custom", 1): (0.1098, 0.3264), ("custom", 2): (0.0496, 0.1721)}
# deepspeed 0.18.3 / transformers 5.0.0, unpatched: the hook divides the loss's gradient by GAS, and
# under ZeRO-2 again the logits' (both models return their logits next to the loss, on its path).
MEASURED_SCALE = {(2, "causal-lm"): 1 / 64, (2, "custom"): 1 / 64, (3, "causal-lm"): 1 / 8, (3, "custom"): 1 / 8}
pytestmark = pytest.mark.distributed


def trainer_request(stage, model, nproc, also_last=False):
    return [builders.trainer_gas_request(model=model, nproc=nproc, gas=8, extra_args=("--zero-stage", str(stage)),
                                       also_last=also_last)]


def accumulator_request(stage, model, nproc):
    return trainer_request(stage, model, nproc, also_last=True)


def states(result, fix_id):
    return {s[fix_id] for s in result["rank_status"]}


@pytest.mark.stack("2025-10")
@pytest.mark.parametrize("stage, model, nproc", CELLS, ids=CELL_IDS)
@uses(accumulator_request)
def test_accumulator_keeps_every_micro_batch(ranks, stage, model, nproc):
    result = ranks.result(*accumulator_request(stage, model, nproc))
    bug, fixed = result["unpatched"], result["patched"]
    if stage == 2:  # only each rank's last micro-batch of the window reaches the update
        assert bug["vs_last"]["rel_err"] < EXACT, bug
        ratio, cosine = MEASURED_LAST[(model, nproc)]
        assert (bug["ratio"], bug["cosine"]) == pytest.approx((ratio, cosine), abs=1e-3), bug
    else:  # ZeRO-3 accumulates through its own micro_step_id
        assert bug["rel_err"] < EXACT, bug
    assert states(bug, ACCUMULATOR) == {"inactive"}
    assert fixed["rel_err"] < EXACT, fixed
    assert states(fixed, ACCUMULATOR) == {"applied"} and states(fixed, SCALE) == {"not-affected"}


@pytest.mark.stack("2025-12")
@pytest.mark.parametrize("stage, model, nproc", CELLS, ids=CELL_IDS)
@uses(trainer_request)
def test_scale_wrt_gas_false_is_honoured(ranks, stage, model, nproc):
    result = ranks.result(*trainer_request(stage, model, nproc))
    bug, fixed = result["unpatched"], result["patched"]
    assert bug["ratio"] == pytest.approx(MEASURED_SCALE[(stage, model)], rel=1e-4), bug
    assert bug["cosine"] > 1 - 1e-9, bug
    assert states(bug, SCALE) == {"inactive"}
    assert fixed["rel_err"] < EXACT, fixed
    assert states(fixed, SCALE) == {"applied"} and states(fixed, ACCUMULATOR) == {"not-affected"}


def in_range(fix_id: str) -> bool:
    return versions.version_in_range(metadata.version("deepspeed"), catalogue.by_id(fix_id).affected)


def test_structural_checks_recognise_the_broken_originals_exactly_on_their_releases():
    """Each check accepts the upstream method measured broken and nothing else: on this stack's
    DeepSpeed it must say "broken" exactly when the version range does."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from zerofix.fixes import deepspeed_offload_accumulator, deepspeed_scale_wrt_gas, deepspeed_zero12_accumulator

    epilogue = DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue
    drift = deepspeed_zero12_accumulator.structural_check(ACCUMULATOR, {deepspeed_zero12_accumulator.TARGET: epilogue}).drift
    assert (drift is None) == in_range(ACCUMULATOR), drift
    cpu_accumulator = DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu
    drift = deepspeed_offload_accumulator.structural_check(OFFLOAD, {deepspeed_offload_accumulator.TARGET: cpu_accumulator}).drift
    assert (drift is None) == in_range(OFFLOAD), drift
    hook = getattr(DeepSpeedEngine, "_backward_prologue_per_tensor", None)
    if hook is None:  # before 0.18.3 the division happens inside backward()
        assert not in_range(SCALE)
    else:
        drift = deepspeed_scale_wrt_gas.structural_check(SCALE, {deepspeed_scale_wrt_gas.HOOK: hook,
                                                                 deepspeed_scale_wrt_gas.BACKWARD: DeepSpeedEngine.backward}).drift
        assert (drift is None) == in_range(SCALE), drift



def test_patch_installs_exactly_the_fixes_in_range():
    """On latest both backports report not-affected and leave DeepSpeed's methods as they are; on their
    own stacks they wrap them (layered with deepspeed-manual-accumulation on backward, and with
    deepspeed-output-hook-division on backward and the per-tensor hook from 0.18.3)."""
    proc = run_python("""
        import json, zerofix
        zerofix.patch()
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        def layers(owner, name):
            value, n = vars(owner).get(name), 0
            while type(value).__name__ == "FunctionWrapper":
                value, n = value.__wrapped__, n + 1
            return n
        print(json.dumps({
            "states": {r.id: r.state for r in zerofix.status()},
            "epilogue": layers(DeepSpeedZeroOptimizer, "independent_gradient_partition_epilogue"),
            "hook": layers(DeepSpeedEngine, "_backward_prologue_per_tensor"),
            "backward": layers(DeepSpeedEngine, "backward"),
        }))
    """)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for fix_id in (ACCUMULATOR, SCALE):
        assert seen["states"][fix_id] == ("applied" if in_range(fix_id) else "not-affected"), seen
    hooks = int(in_range(HOOK))  # deepspeed-output-hook-division wraps the same two methods from 0.18.3 on
    assert seen["epilogue"] == int(in_range(ACCUMULATOR))
    assert seen["hook"] == int(in_range(SCALE)) + hooks
    # deepspeed-manual-accumulation is in range everywhere
    assert seen["backward"] == 1 + int(in_range(SCALE)) + hooks
