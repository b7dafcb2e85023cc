"""Which engines the lazy boundary takes over, and which it passes through (no DeepSpeed needed: the
decision reads a handful of engine attributes; the reductions themselves are tested on real engines in
test_deepspeed_accumulation.py)."""
from __future__ import annotations

import pytest

from zerofix.fixes.deepspeed_manual_accumulation import _eligibility

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


class Engine:
    def __init__(self, optimizer, *, fp16=False, bf16=False, managed=True, pipeline=False, flag=True):
        if flag:
            self._is_gradient_accumulation_boundary = None
        self.optimizer, self.pipeline_parallelism = optimizer, pipeline
        self._fp16, self._bf16, self._managed = fp16, bf16, managed

    def fp16_enabled(self):
        return self._fp16

    def bfloat16_enabled(self):
        return self._bf16

    def managed_gradient_accumulation(self):
        return self._managed


class Zero12:
    bit16_groups = ()
    cpu_offload = False

    def reduce_ready_partitions_and_remove_grads(self, param, i): ...

    def overlapping_partition_gradients_reduce_epilogue(self): ...


class Offloaded(Zero12):
    cpu_offload = True


class Zero12Buckets1718(Zero12):  # deepspeed 0.17.x - 0.18.2: ipg_buckets, no setup_buckets
    ipg_buckets = {}

    def independent_gradient_partition_epilogue(self):  # the shape of 0.17.6-0.18.2's broken test
        for i in range(len(self.bit16_groups)):
            if self.averaged_gradients.get(i) is None:
                self.all_grad_tensors[i] = []


class Zero12Buckets1715(Zero12Buckets1718):  # the same layout with a sound accumulator test
    def independent_gradient_partition_epilogue(self):
        for i in range(len(self.bit16_groups)):
            if self.all_grad_tensors.get(i) is None:
                self.all_grad_tensors[i] = []


class Zero12Buckets(Zero12Buckets1715):  # >= 0.18.3
    def setup_buckets(self): ...


@pytest.mark.parametrize("engine, stage, eligible, why", [
    # ZeRO-0/3 accumulate several backwards per step() by themselves at config GAS=1; at GAS > 1 a manual
    # loop cannot be told from DeepSpeed's own style with several backwards per micro-batch: never taken over
    (Engine(object()), 0, False, "accumulate by themselves"),
    (Engine(object(), bf16=True), 0, False, "ZeRO-0"),
    (Engine(Zero12()), 1, True, "bucket"),
    (Engine(Zero12()), 2, True, "bucket"),
    (Engine(Offloaded()), 2, False, "offload"),  # the offload path's API is missing from this fake
    (Engine(Zero12Buckets1718()), 2, False, "without deepspeed-zero12-accumulator"),
    (Engine(Zero12Buckets1715()), 2, True, "bucket"),
    (Engine(Zero12Buckets1718()), 1, True, "bucket"),
    (Engine(Zero12Buckets()), 2, True, "bucket"),
    (Engine(object()), 2, False, "not measured"),  # an optimizer without ZeRO-1/2's reduction API
    (Engine(object()), 3, False, "ZeRO-3"),
    (Engine(Zero12(), managed=False), 2, False, "managed_gradient_accumulation"),
    (Engine(Zero12(), pipeline=True), 2, False, "pipeline"),
    (Engine(Zero12(), flag=False), 2, False, "_is_gradient_accumulation_boundary"),
])
def test_eligibility(engine, stage, eligible, why):
    ok, reason = _eligibility(engine, stage)
    assert ok is eligible and why in reason, reason


def test_zero2_on_the_broken_accumulator_is_taken_over_once_it_is_fixed(monkeypatch):
    from zerofix import applied

    monkeypatch.setattr(applied, "is_applied", lambda fix_id: fix_id == "deepspeed-zero12-accumulator")
    ok, reason = _eligibility(Engine(Zero12Buckets1718()), 2)
    assert ok and "bucket" in reason, reason


@pytest.mark.parametrize("kind", ["pipeline", "unmanaged"])
def test_engines_outside_deepspeeds_schedule_are_not_even_counted(kind):
    """Pipeline engines and managed_gradient_accumulation: false decide their own boundaries: both wrappers
    call straight through (no count, no warning, no boundary flag touched)."""
    from zerofix.fixes import deepspeed_manual_accumulation as fix

    class Full(Engine):
        module = type("M", (), {"parameters": lambda self: iter(())})()

        def zero_optimization_stage(self):
            return 2

        def gradient_accumulation_steps(self):
            return 4

        def is_gradient_accumulation_boundary(self):
            raise AssertionError("not consulted")

    engine = Full(Zero12(), pipeline=kind == "pipeline", managed=kind != "unmanaged")
    calls = []
    for _ in range(3):
        fix.backward(lambda *a: calls.append("backward"), engine, (1.0,), {})
    fix.step(lambda *a: calls.append("step"), engine, (), {})
    state = engine.__dict__[fix._STATE_KEY]
    assert calls == ["backward"] * 3 + ["step"] and not state.observes
    assert (state.counter.backwards, state.counter.steps, state.warned) == (0, 0, [])
    assert engine._is_gradient_accumulation_boundary is None
