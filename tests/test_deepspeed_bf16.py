"""deepspeed-bf16-boundary-reduction: ZeRO-1 bf16 with an fp32 gradient accumulator (BF16_Optimizer), through
the Trainer on 2 gloo ranks (DeepSpeed's own loop: the ``-acc32`` cells of test_deepspeed_accumulation.py).

Each run is compared with the float64 single-process reference on the same samples. On 0.18.9 the boundary
micro-batch reaches the update unaveraged (unpatched: the measured error); patched, the error is bf16 rounding,
the very number DeepSpeed 0.19.8 reaches by itself (asserted on latest, where the entry does not apply and
zerofix leaves every weight bitwise as it was). On 0.18.3 the same configuration gets FP16_UnfusedOptimizer (DeepSpeed's
BFLOAT16 and DDP_BFLOAT16 constants are both "bf16" up to 0.18.4), whose loss scale divides a gradient that was
never scaled: no update at all unpatched (#7837), and right patched, where deepspeed-bf16-loss-scale drops that scale.

deepspeed-bf16-loss-scale through the Trainer: ZeRO-0 in bf16 (FP16_UnfusedOptimizer), two windows. On 0.18.3 the
update is nothing unpatched and right patched; on 0.18.0 the update is right either way (the Trainer zeroes the
gradients itself between steps, so nothing carries), bitwise the same with and without zerofix, and the gradient norm
the Trainer logs is the loss-scaled one unpatched (65536 times too large); on 0.19.8, untouched.
"""
from __future__ import annotations

import pytest

from conftest import detect_stack, uses
from zerofix.check import builders

FIX = "deepspeed-bf16-boundary-reduction"
STACK = detect_stack()
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"},
          "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
MODELS = ("causal-lm", "custom")
CELLS = [{"name": model, "model": model, "gas": 4, "bf16": True} for model in MODELS]
# Trainer, GAS=4, 2 ranks, relative error of the update against the float64 reference. Right: what 0.19.8 reaches
# unpatched (bf16 rounding), measured; 0.18.9 unpatched: the boundary micro-batch unaveraged.
RIGHT = {"causal-lm": 0.00984, "custom": 0.00595}
UNAVERAGED = {"causal-lm": 0.6173, "custom": 0.5597}
# 0.18.3 patched: FP16_UnfusedOptimizer without its loss scale (bf16 accumulation, not the fp32 accumulator), measured
UNFUSED_RIGHT = {"causal-lm": 0.00984, "custom": 0.00560}
ACC32_STACKS = ("latest", "2026-04", "2025-12")
ZERO0_STACKS = ("latest", "2025-12", "2025-10")
pytestmark = [pytest.mark.distributed, pytest.mark.stack(*dict.fromkeys(ACC32_STACKS + ZERO0_STACKS))]

REQUEST = builders.trainer_request(CELLS, nproc=2, zero_stage=1, ds_config=CONFIG, name="trainer-bf16")
ZERO0_CONFIG = {key: value for key, value in CONFIG.items() if key != "data_types"} | {"zero_optimization": {"stage": 0}}
ZERO0_CELLS = [{**cell, "samples": 32} for cell in CELLS]  # two windows: 2 x GAS x 2 samples x 2 ranks
ZERO0 = builders.trainer_request(ZERO0_CELLS, nproc=2, zero_stage=0, ds_config=ZERO0_CONFIG, name="trainer-bf16-zero0")
# Trainer, ZeRO-0 bf16, GAS=4, two windows: the worst window's relative error, what 0.19.8 reaches (measured; the
# patched 0.18.0 and 0.18.3 reach the same)
RIGHT_ZERO0 = {"causal-lm": 0.00984, "custom": 0.00720}
LOSS_SCALE = 2.0 ** 16


def requests():
    return [REQUEST]


def zero0_requests():
    return [ZERO0]


def states(result):
    return {s[FIX] for s in result["rank_status"]}


@pytest.mark.stack(*ACC32_STACKS)
@pytest.mark.parametrize("model", MODELS)
@uses(requests)
def test_the_boundary_micro_batch_is_averaged(ranks, model):
    result = ranks.result(REQUEST)[model]
    bug, fixed = result["unpatched"], result["patched"]
    if STACK == "2026-04":  # 0.18.9: in range
        assert bug["rel_err"] == pytest.approx(UNAVERAGED[model], abs=2e-3), bug
        assert states(bug) == {"inactive"} and states(fixed) == {"applied"}
        assert fixed["rel_err"] == pytest.approx(RIGHT[model], abs=1e-4), fixed
    elif STACK == "latest":  # 0.19.8: right by itself, the entry not applied, every weight as it was
        assert bug["rel_err"] == pytest.approx(RIGHT[model], abs=1e-4), bug
        assert states(fixed) == {"not-affected"} and fixed["bitwise_as_unpatched"], fixed
    else:  # 0.18.3: this configuration gets FP16_UnfusedOptimizer, which applies nothing (deepspeed-bf16-loss-scale)
        assert states(fixed) == {"applied"} and loss_scale_states(fixed) == {"applied"}
        assert bug["rel_err"] == pytest.approx(1.0, abs=1e-4) and abs(bug["ratio"]) < 1e-5, bug
        assert fixed["rel_err"] == pytest.approx(UNFUSED_RIGHT[model], abs=1e-4), fixed


def loss_scale_states(result):
    return {s["deepspeed-bf16-loss-scale"] for s in result["rank_status"]}


@pytest.mark.stack(*ZERO0_STACKS)
@pytest.mark.parametrize("model", MODELS)
@uses(zero0_requests)
def test_zero0_bf16_trains_without_a_loss_scale(ranks, model):
    result = ranks.result(ZERO0)[model]
    bug, fixed = result["unpatched"], result["patched"]
    assert len(fixed["per_window"]) == 2
    assert fixed["rel_err"] == pytest.approx(RIGHT_ZERO0[model], abs=1e-4), fixed
    if STACK == "latest":  # 0.19.8: right by itself, the entry not applied, every weight as it was
        assert loss_scale_states(fixed) == {"not-affected"} and fixed["bitwise_as_unpatched"], fixed
        return
    assert loss_scale_states(bug) == {"inactive"} and loss_scale_states(fixed) == {"applied"}
    if STACK == "2025-12":  # 0.18.3: fp16's loss scale divides a gradient nobody scaled
        assert bug["rel_err"] == pytest.approx(1.0, abs=1e-4) and abs(bug["ratio"]) < 1e-5, bug
    else:  # 0.18.0: the scale is applied, so the update is right and the same; the norm it reports is the scaled one
        assert fixed["bitwise_as_unpatched"], fixed
        for scaled, right in zip(bug["grad_norms"], fixed["grad_norms"], strict=True):
            assert len(right) == 2 and scaled == pytest.approx([n * LOSS_SCALE for n in right], rel=1e-5)
