"""The import/patch/unpatch orderings of test_contract.py, with every real catalogue entry on the stacks where
it applies (the real library, its real targets, a fresh interpreter per entry).

For each entry in range: patch before the library is imported and after it, patch twice, patch / unpatch /
patch, unpatch without patch (before and after the import), and an explicit exclude after patch. ``unpatch()`` must put back the identical
objects (``is``, not equality) on every target; a second ``patch()`` must change nothing. That a training
step still matches the reference after patch / unpatch / patch is shown by the ``repatched`` variants of the
scenarios (test_deepspeed_accumulation.py, test_trainer_scaling.py) and, for the TRL entry, here.
"""
from __future__ import annotations

import pytest

from conftest import home_stack, run_python
from zerofix import catalogue, versions

pytestmark = pytest.mark.slow


def in_range(fix: catalogue.Fix) -> bool:
    version = versions.installed_version(fix.dist)
    return version is not None and versions.version_in_range(version, fix.affected)


PRELUDE = """
import importlib, sys
import wrapt
import zerofix
from zerofix import catalogue

FIX_ID = {fix_id!r}
fix = catalogue.by_id(FIX_ID)
MISSING = object()


def state():
    return next(r for r in zerofix.status() if r.id == FIX_ID).state


def current():
    '''Every present target's own value in its owner's namespace (MISSING where it is inherited).'''
    out = {{}}
    for t in fix.targets:
        owner = sys.modules[t.module]
        *path, name = t.attribute.split(".")
        try:
            for part in path:
                owner = getattr(owner, part)
            getattr(owner, name)
        except AttributeError:
            assert t.optional, t  # only an optional target may be absent from a release
            continue
        out[t.module + ":" + t.attribute] = vars(owner).get(name, MISSING)
    return out


def assert_identical(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        assert a[key] is b[key], (what, key, a[key], b[key])


def assert_raw(values, what):
    for key, value in values.items():
        assert not isinstance(value, wrapt.FunctionWrapper), (what, key, value)


def assert_wrapped(values, raw, what):
    for key, value in values.items():
        assert isinstance(value, wrapt.FunctionWrapper), (what, key, value)
        inner = value
        while isinstance(inner, wrapt.FunctionWrapper):  # zerofix's layer(s) around the raw value
            inner = inner.__wrapped__
        if raw is not None:
            expected = raw[key]
            assert inner is expected or (expected is MISSING and inner is not None), (what, key)


def import_targets():
    for module in fix.modules:
        importlib.import_module(module)
"""

# One interpreter per entry: first the orderings that need the library not imported yet, then, with it
# imported, those that patch after the import.
ORDERINGS = """
zerofix.unpatch([FIX_ID])  # unpatch without patch, before anything is imported: a no-op
assert not [m for m in fix.modules if m in sys.modules]
zerofix.patch([FIX_ID])
assert state() == "pending-import", state()
import_targets()  # the post-import hooks apply it
assert state() == "applied", zerofix.status()
wrapped = current()
assert_wrapped(wrapped, None, "patch then import")
zerofix.patch([FIX_ID])  # patch twice: nothing changes
assert_identical(current(), wrapped, "patch twice")
zerofix.unpatch([FIX_ID])
raw = current()
assert_raw(raw, "unpatch")

# the library is imported now: every call below patches after the import
zerofix.unpatch([FIX_ID])  # unpatch without patch
assert_identical(current(), raw, "unpatch without patch")
zerofix.patch([FIX_ID])
assert state() == "applied", zerofix.status()
wrapped = current()
assert_wrapped(wrapped, raw, "import then patch")
zerofix.patch([FIX_ID])
assert_identical(current(), wrapped, "patch twice after import")
zerofix.unpatch([FIX_ID])
assert_identical(current(), raw, "unpatch")
zerofix.patch([FIX_ID]); zerofix.unpatch([FIX_ID]); zerofix.patch([FIX_ID])
assert state() == "applied"
assert_wrapped(current(), raw, "patch / unpatch / patch")
zerofix.patch([], exclude=[FIX_ID])  # an explicit exclude after patch wins: unpatched
assert state() == "disabled", state()
assert_identical(current(), raw, "exclude after patch")
zerofix.patch([FIX_ID])  # and it can come back
assert state() == "applied"
{after_repatch}
zerofix.unpatch()
assert_identical(current(), raw, "unpatch all")
print("ok")
"""

# The TRL entry's training step after patch / unpatch / patch: TRL's chunked loss through the wrapper, against
# the full logits in float64 (loss and both gradients), outside any DeepSpeed (no ZeRO-3 head: the wrapper hands
# TRL its own function; the crash it fixes needs ZeRO-3: test_trl_chunked_nll.py).
TRL_STEP = """
import torch
import torch.nn.functional as F
from trl.trainer import sft_trainer

torch.manual_seed(0)
hidden = torch.randn(2, 7, 16, requires_grad=True)
weight = torch.randn(32, 16, requires_grad=True)
labels = torch.randint(0, 32, (2, 7))
labels[0, :3] = -100
loss = sft_trainer._chunked_cross_entropy_loss(hidden, weight, chunk_size=3, labels=labels)[0]
loss.backward()
h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
ref = F.cross_entropy((h64[:, :-1] @ w64.T).reshape(-1, 32), labels[:, 1:].reshape(-1), ignore_index=-100)
ref.backward()
for got, want in ((loss.detach(), ref.detach()), (hidden.grad, h64.grad), (weight.grad, w64.grad)):
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 1e-6, err  # float32 against float64 from the same inputs
"""

# TRL's GRPO trainers import TRL's vLLM client, which needs requests: only the trl1* stacks install it.
NEEDS_REQUESTS = ("trl-grpo-window-normalisation", "trl-gspo-token-window-normalisation")


def skip_reason(fix: catalogue.Fix) -> str | None:
    if not in_range(fix):
        return f"{fix.dist} not in {fix.affected}"
    if fix.id in NEEDS_REQUESTS and versions.installed_version("requests") is None:
        return "requests is not installed: trl's GRPO trainer cannot be imported on this stack"
    return None


def marks(fix: catalogue.Fix) -> list:
    """Each entry's orderings run on one stack, the first in CI's order with the entry in range (its home stack):
    the same wrappers on every stack in range, so once is enough; on the others they are skipped (CI: deselected)."""
    home = home_stack(fix.dist.lower(), fix.affected, needs=("requests",) if fix.id in NEEDS_REQUESTS else ())
    return [pytest.mark.stack(home)] if home else []


ENTRIES = [pytest.param(fix, marks=[*marks(fix), pytest.mark.skipif(skip_reason(fix) is not None,
                                                                   reason=str(skip_reason(fix)))])
           for fix in catalogue.FIXES]


@pytest.mark.parametrize("fix", ENTRIES, ids=catalogue.ids())
def test_every_ordering_restores_the_identical_objects(fix):
    step = TRL_STEP if fix.id in ("trl-chunked-nll-zero3", "trl-chunked-nll-gather-zero3") else ""
    out = run_python(PRELUDE.format(fix_id=fix.id) + ORDERINGS.format(after_repatch=step), timeout=300).stdout
    assert out.strip().endswith("ok")
