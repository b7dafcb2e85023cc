"""The Trainer through accelerate's FSDP2 on CPU (issue 39): the path most non-DeepSpeed GPU runs take.

accelerate picks FSDP only for an accelerator; ``zerofix.check.fsdp_cpu`` replaces that one choice in the test
process (a CPU AcceleratorState built with an FSDP plugin becomes an FSDP state, as on a GPU). From there on it is
accelerate's and torch's FSDP2: ``fully_shard``, DTensor parameters, gradients reduce-scattered over gloo. Each run
asserts which engine trained (``accelerator.distributed_type`` FSDP, every parameter a DTensor), so a silent
fall-back to DDP fails here.

On the H200 the entry missed the classifiers (4.0 -> 4.0 on 4.57 - 5.17) and harmed 5.3's right one (1.0 -> 4.0)
under FSDP: FSDP2's mixed precision asks ``torch.is_floating_point`` of every forward argument, which the old watch
took for a read of ``num_items_in_batch``. The bf16 cells reproduce that on CPU (the old watch: 8.0 -> 8.0 on
latest, 2 ranks); the fp32 cells are the plain FSDP2 path. The same cells as test_trainer_scaling.py: unpatched,
the factor measured without FSDP on that stack (FSDP2 divides and averages as DDP does: accelerate's backward is
the same); patched, the float64 reference; where upstream is right, bitwise its weights.

accelerate 1.1.1 / 1.3.0 (2024-11, 2025-01) have no FSDP2; FSDP1 on CPU stops in torch's own device handling
(docs/fixes.md, "Paths"): FSDP1 is measured on a GPU only (tests/test_gpu.py).
"""
from __future__ import annotations

import pytest

from conftest import uses
from test_trainer_scaling import ENTRY, EXACT, head_factor, measured_unpatched
from zerofix.check import builders

pytestmark = pytest.mark.distributed
FSDP2_STACKS = ("latest", "2026-04", "2025-12", "2025-10")
BF16 = 0.03  # relative error of a bf16 update against the float64 reference (measured 0.0075 - 0.0099)
HEADS = ("seq-cls-llama", "causal-lm/subclass-mean", "causal-lm/func-mean")


def fsdp_cells() -> list[dict]:
    cells = [{"name": h.replace("/", "-"), "model": h.partition("/")[0], "loss": h.partition("/")[2] or "model",
              "gas": 4, "lr": 2.0, "head": True} for h in HEADS]
    cells.append({"name": "causal-lm", "model": "causal-lm", "gas": 4, "lr": 5.0})
    cells += [{**cell, "name": cell["name"] + "-bf16", "bf16": True} for cell in cells[:1] + cells[-1:]]
    return cells


# 5.0 and 4.57: two ranks only, for CI time (one rank measured equal to latest's there)
TWO_RANKS_ONLY = ("2025-12", "2025-10")


def fsdp_requests(stack, nproc):
    if stack in TWO_RANKS_ONLY and nproc == 1:
        return []
    return [builders.trainer_request(fsdp_cells(), nproc=nproc, fsdp=2, name="trainer-fsdp2")]


@pytest.mark.stack(*FSDP2_STACKS)
@pytest.mark.parametrize("nproc", [1, 2], ids=["1rank", "2rank"])
@uses(fsdp_requests)
def test_the_trainer_on_fsdp2_divides_exactly_once(ranks, stack, nproc):
    if not fsdp_requests(stack, nproc):
        pytest.skip("two ranks on this stack (TWO_RANKS_ONLY)")
    results = ranks.result(*fsdp_requests(stack, nproc))
    for cell in fsdp_cells():
        bug, fixed = results[cell["name"]]["unpatched"], results[cell["name"]]["patched"]
        where = f"{cell['name']} fsdp2 ranks={nproc}"
        for run in (bug, fixed):  # which engine really trained, read inside the run
            for engine in run["engine"]:
                assert engine["distributed_type"] == "FSDP" and engine["fsdp_version"] == 2, (where, engine)
                assert engine["dtensor_params"], (where, engine)
        exact = BF16 if cell.get("bf16") else EXACT
        expected = measured_unpatched(stack, cell["model"], None, cell["gas"], cell, nproc)
        assert bug["ratio"] == pytest.approx(expected, rel=1e-2 if cell.get("bf16") else 1e-4), (where, bug)
        if expected == 1.0:
            assert bug["rel_err"] < exact, (where, bug)
            assert fixed["bitwise_as_unpatched"] in (True, None), (where, fixed["rel_err"])
        assert fixed["rel_err"] < exact, (where, fixed)
        assert fixed["ratio"] == pytest.approx(1.0, rel=1e-2), (where, fixed)
        assert all(s[ENTRY] == "applied" for s in fixed["rank_status"]), (where, fixed["rank_status"])


def test_the_unpatched_factors_are_those_without_fsdp():
    """What the matrix above asserts unpatched is the no-DeepSpeed table of test_trainer_scaling.py."""
    cell = fsdp_cells()[0]
    assert head_factor("2026-04", None, 1, cell) == 1 and head_factor("latest", None, 2, cell) == 8
