"""accelerate-short-last-window in one process, on the shapes of loop the 2-rank matrix does not train
(tests/test_accelerate_loop.py trains the plain loop on every stack, 1 and 2 ranks, with and without
DeepSpeed).

A real ``Accelerator(gradient_accumulation_steps=3)`` over 5 micro-batches (windows of 3 and 2). The gradient
each window hands to ``optimizer.step()`` is read and compared with the float64 gradient of the mean of its
micro-batches' losses, computed by hand on the same weights:

- ``plain``: one backward per micro-batch;
- ``split``: the last micro-batch's loss is backpropagated in two halves (two backwards in the closing
  micro-batch: the second must be scaled once, not twice);
- ``clipped``: ``accelerator.clip_grad_norm_`` between backward and step, with a norm below the window's:
  the rescale must come before the clipping.
- ``two-epochs``: 2 epochs of 5: each epoch's short window, and the full window opening the second epoch.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow
FIX = "accelerate-short-last-window"

SCRIPT = r"""
import json, sys
import torch
import zerofix

if sys.argv[1] == "patched":
    zerofix.patch(fixes=[{fix!r}])
from accelerate import Accelerator
from torch.utils.data import DataLoader

GAS, N, CLIP = 3, 5, 0.01
torch.manual_seed(0)
X, Y = torch.randn(N, 2, 4), torch.randn(N, 2, 1)


def loss_of(model, i):
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(X[i].to(dtype)), Y[i].to(dtype))


results = {{}}
for case in ("plain", "split", "clipped", "two-epochs"):
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(list(range(N)), batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    windows, current = [], []
    for i in (int(b) for _ in range(2 if case == "two-epochs" else 1) for b in loader):
        with accelerator.accumulate(model):
            current.append(i)
            before = {{n: p.detach().double().clone() for n, p in model.named_parameters()}} if len(current) == 1 else before
            loss = loss_of(model, i)
            if case == "split" and accelerator.sync_gradients:
                accelerator.backward(loss * 0.25, retain_graph=True)
                accelerator.backward(loss * 0.75)
            else:
                accelerator.backward(loss)
            if case == "clipped" and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            if accelerator.sync_gradients:
                grads = {{n: p.grad.double().clone() for n, p in model.named_parameters()}}
                reference = torch.nn.Linear(4, 1).double()
                reference.load_state_dict(before)
                torch.stack([loss_of(reference, j) for j in current]).mean().backward()
                ref = {{n: p.grad for n, p in reference.named_parameters()}}
                if case == "clipped":
                    total = torch.sqrt(sum(g.pow(2).sum() for g in ref.values()))
                    ref = {{n: g * min(1.0, CLIP / (total.item() + 1e-6)) for n, g in ref.items()}}
                scale = max(g.abs().max().item() for g in ref.values())
                err = max((grads[n] - ref[n]).abs().max().item() for n in ref) / scale
                ratio = (grads["weight"].norm() / ref["weight"].norm()).item()
                windows.append({{"micro_batches": list(current), "err": err, "ratio": ratio}})
                current = []
            optimizer.step()
            optimizer.zero_grad()
    results[case] = windows
print("RESULT" + json.dumps(results))
"""


def run(variant: str) -> dict:
    proc = run_python(SCRIPT.format(fix=FIX), args=(variant,), timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def measured():
    return run("unpatched"), run("patched")


@pytest.mark.parametrize("case", ["plain", "split", "clipped", "two-epochs"])
def test_the_short_window_is_its_own_mean(measured, case):
    unpatched, patched = measured[0][case], measured[1][case]
    lengths = [w["micro_batches"] for w in patched]
    assert lengths == ([[0, 1, 2], [3, 4]] * (2 if case == "two-epochs" else 1)), lengths
    assert [w["micro_batches"] for w in unpatched] == lengths
    for bug, fixed in zip(unpatched, patched):
        assert fixed["err"] < 1e-6, (case, fixed)
        if len(fixed["micro_batches"]) == 3:  # a full window: untouched
            assert bug["err"] < 1e-6, (case, bug)
        elif case != "clipped":  # the short window: 2/3 of its mean unpatched
            assert bug["ratio"] == pytest.approx(2 / 3, rel=1e-5), (case, bug)
        else:  # clipped to a norm below the window's: the scale no longer matters, unpatched or patched
            # (a rescale after the clipping would leave the patched gradient 1.5 x too long: err 0.5)
            assert bug["err"] < 1e-6, (case, bug)
