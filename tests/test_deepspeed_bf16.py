"""deepspeed-bf16-boundary-reduction: ZeRO-1 bf16 with an fp32 gradient accumulator (BF16_Optimizer), through
the Trainer on 2 gloo ranks (DeepSpeed's own loop: the ``-acc32`` cells of test_deepspeed_accumulation.py).

Each run is compared with the float64 single-process reference on the same samples. On 0.18.9 the boundary
micro-batch reaches the update unaveraged (unpatched: the measured error); patched, the error is bf16 rounding,
the very number DeepSpeed 0.19.8 reaches by itself (asserted on latest, where the entry does not apply and
zerofix leaves every weight bitwise as it was). On 0.18.3 the same configuration gets FP16_UnfusedOptimizer (DeepSpeed's
BFLOAT16 and DDP_BFLOAT16 constants are both "bf16" up to 0.18.4), whose loss scale divides a gradient that was
never scaled: no update at all, with and without zerofix (#7837's mechanism, not backported: docs/fixes.md).
"""
from __future__ import annotations

import pytest

from conftest import detect_stack, uses
from zerofix.check import parity

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
pytestmark = [pytest.mark.distributed, pytest.mark.stack("latest", "2026-04", "2025-12")]

REQUEST = parity.trainer_request(CELLS, nproc=2, zero_stage=1, ds_config=CONFIG, name="trainer-bf16")


def requests():
    return [REQUEST]


def states(result):
    return {s[FIX] for s in result["rank_status"]}


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
    else:  # 0.18.3: the method is broken, but this configuration gets FP16_UnfusedOptimizer, which applies nothing
        assert states(fixed) == {"applied"}
        for run in (bug, fixed):
            assert run["rel_err"] == pytest.approx(1.0, abs=1e-4) and abs(run["ratio"]) < 1e-5, run
