"""transformers' own Trainer gradient-accumulation tests as peers: what CI keeps of them.

Their sources are neither in transformers' sdist nor fetchable in CI; docs/peers.md has their per-test outcomes
with and without ``ZEROFIX=1`` on ``latest`` and ``2026-04`` (identical: none became a regression test). The ones
that cross zerofix's Trainer entry on DeepSpeed in bf16, ``TestTrainerIntegrationDeepSpeed::test_gradient_accumulation``
(ZeRO-2 and ZeRO-3, one process, a model whose loss ignores ``num_items_in_batch``: one batch of 16 against four
of 4), cross a path zerofix's own matrix runs in fp32 only (tests/test_trainer_scaling.py). This is our
reference making the same assertion on the same path: the Trainer on DeepSpeed ZeRO-2 and ZeRO-3 in bf16, one
process, such a model, GAS=4: the update equals the float64 single-process update of the whole window's mean loss
(to bf16 rounding), and zerofix, whose ``transformers-trainer-scaling`` is applied, leaves every weight bitwise as
upstream's.
"""
from __future__ import annotations

import pytest

from conftest import uses
from zerofix.check import builders

pytestmark = [pytest.mark.distributed, pytest.mark.stack("latest")]

ENTRY = "transformers-trainer-scaling"
STAGES = (2, 3)
CELLS = [{"name": "custom-bf16", "model": "custom", "gas": 4, "bf16": True}]
# upstream's DeepSpeed configuration (tests/trainer/distributed/scripts/ds_config_zero{2,3}.json) without its
# optimizer and scheduler: the reference is the Trainer's SGD at a constant rate
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10**9}
# relative error of the bf16 update against the float64 reference, measured on 0.19.8 (bf16 rounding)
RIGHT = {2: 0.00567, 3: 0.00491}


def request(stage):
    config = {**CONFIG, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return [builders.trainer_request(CELLS, nproc=1, zero_stage=stage, ds_config=config,
                                   name=f"upstream-transformers-zero{stage}")]


@pytest.mark.parametrize("stage", STAGES)
@uses(request)
def test_deepspeed_gradient_accumulation_in_bf16(ranks, stage):
    result = ranks.result(*request(stage))["custom-bf16"]
    bug, fixed = result["unpatched"], result["patched"]
    assert bug["rel_err"] == pytest.approx(RIGHT[stage], abs=1e-4), bug
    assert {s[ENTRY] for s in fixed["rank_status"]} == {"applied"}, fixed["rank_status"]
    assert fixed["bitwise_as_unpatched"], fixed
