"""deepspeed-zero12-accumulator's wrapper on a miniature of the epilogue (no DeepSpeed, no ranks).

``Broken`` tests the accumulator's emptiness on ``averaged_gradients`` as 0.17.6-0.18.2 do; ``Sound`` tests
the accumulator itself as 0.18.3 does. Over any sequence of boundary / non-boundary backwards and steps,
the wrapped broken epilogue must leave exactly what the sound one leaves. The real epilogue on real
engines is measured in test_deepspeed_accumulation.py and test_deepspeed_backports.py.
"""
from __future__ import annotations

import pytest
import torch

from zerofix.fixes import deepspeed_zero12_accumulator as accumulator

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


class Broken:
    cpu_offload = False

    def __init__(self):
        self.bit16_groups = [["w"], ["b"]]
        self.all_grad_tensors, self.averaged_gradients = {}, {}
        self.is_gradient_accumulation_boundary = False
        self.grads = None

    def starts_empty(self, i):
        return i not in self.averaged_gradients or self.averaged_gradients[i] is None

    def independent_gradient_partition_epilogue(self):
        for i, _ in enumerate(self.bit16_groups):
            new = [self.grads[i].clone()]
            if self.starts_empty(i):
                self.all_grad_tensors[i] = new
            else:
                for accumulated, g in zip(self.all_grad_tensors[i], new, strict=True):
                    accumulated.add_(g)
            if self.is_gradient_accumulation_boundary:
                self.averaged_gradients[i] = [t.clone() for t in self.all_grad_tensors[i]]
                self.all_grad_tensors[i] = None

    def step(self):
        applied = [self.averaged_gradients[i][0].clone() for i in range(len(self.bit16_groups))]
        for i in range(len(self.bit16_groups)):
            self.averaged_gradients[i] = self.all_grad_tensors[i] = None
        return applied


class Sound(Broken):
    def starts_empty(self, i):
        return i not in self.all_grad_tensors or self.all_grad_tensors[i] is None


def wrapped_epilogue(opt):
    bound = type(opt).independent_gradient_partition_epilogue.__get__(opt)
    return accumulator.epilogue(bound, opt, (), {})


def run(opt, program, epilogue):
    """program: "n" a non-boundary backward, "B" a boundary backward, "s" a step. Returns each step's
    applied gradients, or the exception's type."""
    applied = []
    for m, op in enumerate(program):
        if op == "s":
            applied.append(opt.step())
            continue
        opt.grads = [torch.full((2,), float(10**m)), torch.full((1,), -float(10**m))]
        opt.is_gradient_accumulation_boundary = op == "B"
        try:
            epilogue(opt)
        except TypeError:
            return TypeError
    return applied


PROGRAMS = {
    "deepspeed style, GAS=4": "nnnBs" * 2,
    "manual, every backward a boundary (config GAS=1)": "BBBBs",
    "explicit boundary on the last": "nnnBs",
    "one micro-batch per step": "BsBs",
}


@pytest.mark.parametrize("program", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_wrapped_broken_epilogue_behaves_as_the_sound_one(program):
    sound = run(Sound(), program, lambda o: o.independent_gradient_partition_epilogue())
    fixed = run(Broken(), program, wrapped_epilogue)
    assert sound is not TypeError
    assert fixed is not TypeError
    assert len(fixed) == len(sound)
    for got, want in zip(fixed, sound, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_miniature_shows_the_measured_bug():
    """Unwrapped: only the last micro-batch (DeepSpeed's own style), or a TypeError (manual, GAS=1)."""
    broken = run(Broken(), PROGRAMS["deepspeed style, GAS=4"],
                 lambda o: o.independent_gradient_partition_epilogue())
    assert [g[0].tolist() for g in broken] == [[1000.0, 1000.0], [10.0**8] * 2]
    assert run(Broken(), PROGRAMS["manual, every backward a boundary (config GAS=1)"],
               lambda o: o.independent_gradient_partition_epilogue()) is TypeError


def test_the_wrapper_leaves_no_placeholder_behind():
    opt = Broken()
    run(opt, "nn", wrapped_epilogue)
    assert all(v is None for v in opt.averaged_gradients.values()) or not opt.averaged_gradients
    assert opt.all_grad_tensors[0][0].tolist() == [11.0, 11.0]


def broken_shape(self):  # how 0.17.6-0.18.2 test the accumulator, in miniature
    for i, _ in enumerate(self.bit16_groups):
        if i not in self.averaged_gradients or self.averaged_gradients[i] is None:
            self.all_grad_tensors[i] = []


def sound_shape(self):  # how 0.18.3 tests it
    for i, _ in enumerate(self.bit16_groups):
        if i not in self.all_grad_tensors or self.all_grad_tensors[i] is None:
            self.all_grad_tensors[i] = []


def test_the_source_check_tells_broken_from_sound():
    assert accumulator.drift_from_broken(broken_shape) is None
    assert "not the broken one" in accumulator.drift_from_broken(sound_shape)
    assert "no longer starts the accumulator" in accumulator.drift_from_broken(Broken.step)
