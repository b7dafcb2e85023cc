"""deepspeed-bf16-boundary-reduction's structural check, on the shapes of DeepSpeed's ``_backward_epilogue``
(no distributed run). The real sources were checked the same way: 0.18.1 and 0.18.2 drift (the gradients are
added in ``optimizer.backward``), 0.18.3 - 0.18.6 and 0.18.9 are the broken order, 0.19.0 drifts (PR #7985)."""
from __future__ import annotations

import pytest

from zerofix.fixes import deepspeed_bf16_boundary_reduction as fix

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


class Shapes:
    def broken(self):  # 0.18.3 - 0.18.9
        self._start_timers(self.engine_timers.backward_reduce_timers)
        if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:
            self.allreduce_gradients()
        if isinstance(self.optimizer, ZeROOptimizer):  # noqa: F821
            self.optimizer.backward_epilogue()
            self.optimizer.exit_backward()

    def fixed(self):  # 0.19.0
        bf16_optimizer = isinstance(self.optimizer, BF16_Optimizer)  # noqa: F821
        if bf16_optimizer:
            self.optimizer.backward_epilogue()
        if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:
            self.allreduce_gradients()
        if isinstance(self.optimizer, ZeROOptimizer) and not bf16_optimizer:  # noqa: F821
            self.optimizer.backward_epilogue()

    def before(self):  # 0.18.0 - 0.18.2: the optimizer added the gradients in its backward()
        if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:
            self.allreduce_gradients()

    def reordered(self):  # a release that reduces after the optimizer's epilogue without naming the class
        self.optimizer.backward_epilogue()
        self.allreduce_gradients()


def test_the_broken_order_is_found():
    assert fix.drift_from_broken(Shapes.broken) is None


@pytest.mark.parametrize("shape, why", [(Shapes.fixed, "already treats BF16_Optimizer apart"),
                                        (Shapes.before, "does not call the optimizer's backward_epilogue"),
                                        (Shapes.reordered, "reduces after the optimizer's epilogue")])
def test_any_other_shape_drifts(shape, why):
    assert why in fix.drift_from_broken(shape)


def test_a_function_without_source_drifts_with_the_reason():
    assert "source unavailable" in fix.drift_from_broken(len)


def test_the_wrapper_moves_the_epilogue_and_counts_it():
    """The wrapper runs a BF16_Optimizer's epilogue before the engine's (whose own call then does nothing), and its
    runtime details count that (what zerofix.status() shows and `zerofix check` names a row's fix from); an engine
    with another optimizer goes through untouched and uncounted."""
    from types import SimpleNamespace

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    fix.reset_runtime()
    ran = []
    optimizer = BF16_Optimizer.__new__(BF16_Optimizer)  # its class is all the wrapper reads
    optimizer.__dict__["backward_epilogue"] = lambda: ran.append("the optimizer's epilogue")
    engine = SimpleNamespace(optimizer=optimizer)

    def engine_epilogue():  # DeepSpeed's order: the all-reduce, then the optimizer's epilogue
        ran.append("the reduction")
        engine.optimizer.backward_epilogue()

    fix.backward_epilogue(engine_epilogue, engine, (), {})
    assert ran == ["the optimizer's epilogue", "the reduction"]
    assert optimizer.__dict__["backward_epilogue"] is not fix._nothing  # restored after the engine's epilogue
    other = SimpleNamespace(optimizer=object())
    fix.backward_epilogue(lambda: ran.append("another engine's epilogue"), other, (), {})
    assert ran[-1] == "another engine's epilogue"
    assert fix.runtime_details() == [{"epilogues_moved": 1, "corrected": 1}]
    fix.reset_runtime()
    assert fix.runtime_details() == [{"epilogues_moved": 0, "corrected": 0}]
