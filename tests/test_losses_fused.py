"""The three-GEMM path of chunked_cross_entropy and its fused Triton kernel (issue 70), on a CPU under Triton's
interpreter (``TRITON_INTERPRET=1``): the same kernel code a GPU compiles, run operation by operation in NumPy.

- The kernel against float64 from the same logits block: loss, log-sum-exp, the gradient it writes in place, the
  argmax hit and the entropy, with every option (bias, scale, softcap, label smoothing, z-loss, row weights with
  ignored rows), a vocabulary no tile divides, one row per program (a GPU's launch) and 16 (the interpreter's).
- The path through the public function: both accuracy policies against float64 from the same rounded inputs;
  ``accurate`` rounds the weight gradient once (the blocked path's error), ``compact`` accumulates it in bf16 per chunk.
- Each check fails when the kernel is wrong: mutants of the kernel's source, each caught by the check that owns it.

No distributed run; the interpreter needs Triton installed (the ``latest`` stack's ``kernels`` extra). Triton reads
``TRITON_INTERPRET`` when it is first imported (its own library's functions are compiled or interpreted from then on),
and a test session imports it early (DeepSpeed imports torch's compiler, which imports Triton): so these tests run in
a fresh interpreter with ``TRITON_INTERPRET=1`` from its start, launched by the one test that runs here without it."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zerofix.losses import chunked_cross_entropy, chunked_cross_entropy_with_stats, function, kernel  # noqa: E402
from zerofix.losses.chunked import Options  # noqa: E402

pytestmark = pytest.mark.stack_independent

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (the latest stack's `kernels` extra installs it)", allow_module_level=True)

SOURCE = Path(kernel.__file__).with_name("triton_rows.py")
ROWS, VOCAB = 37, 200  # no launch's 16 rows or 128 entries divide them
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_the_kernel_tests_pass_in_a_fresh_interpreter_under_triton_s_interpreter():
    """This module's tests, in a Python started with ``TRITON_INTERPRET=1``: every one runs and passes."""
    if INTERPRETED:
        pytest.skip("this is the fresh interpreter")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error::RuntimeWarning",
                           __file__], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and re.fullmatch(r"\d+ passed, 1 skipped in .*", summary), done.stdout + done.stderr


@pytest.fixture(autouse=True)
def interpreted(request):
    if request.node.name.startswith("test_the_kernel_tests_pass_in_a_fresh_interpreter"):
        return
    if not INTERPRETED:
        pytest.skip("runs in a fresh interpreter under TRITON_INTERPRET=1 (the first test of this module launches it)")
    assert type(kernel.module().ce_rows_kernel).__name__ == "InterpretedFunction"


def options(**kw) -> Options:
    return Options(None, kw.get("label_smoothing", 0.0), kw.get("logit_softcap"), kw.get("z_loss", 0.0),
                   kw.get("logit_scale", 1.0), 1.0, False, torch.float32)


def reference(z, y, w, bias, **kw):
    """float64: per-row loss, log-sum-exp, d(sum_i w_i loss_i)/dz, argmax hit, entropy."""
    raw = z.double().requires_grad_()
    x = raw + (0 if bias is None else bias.double())
    x = x * kw.get("logit_scale", 1.0)
    if kw.get("logit_softcap") is not None:
        x = kw["logit_softcap"] * torch.tanh(x / kw["logit_softcap"])
    lse = torch.logsumexp(x, dim=-1)
    loss = F.cross_entropy(x, y, reduction="none", label_smoothing=kw.get("label_smoothing", 0.0))
    loss = loss + kw.get("z_loss", 0.0) * lse * lse
    (loss * w.double()).sum().backward()
    p = torch.softmax(x, dim=-1)
    entropy = lse - (p * x).sum(dim=-1)
    return loss.detach(), lse.detach(), raw.grad, (x.argmax(dim=-1) == y).int(), entropy.detach()


def run_kernel(z, y, w, bias, shape, impl=None, **kw):
    block = z.clone()
    loss, lse, (hit, entropy) = kernel.rows_loss_and_dlogits(block, y, w, bias, options(**kw), True, True, shape,
                                                             impl=impl)
    return loss, lse, block, hit, entropy


def errors(got, want) -> dict:
    names = ("loss", "lse", "dlogits", "hit", "entropy")
    out = {}
    for name, g, r in zip(names, got, want):
        if name == "hit":
            out[name] = float((g.int() != r).sum())
        else:
            out[name] = float((g.double() - r).abs().max() / r.abs().max().clamp(min=1e-30))
    return out


CASES = {
    "plain": {},
    "bias": {"bias": True},
    "scale": {"logit_scale": 0.7},
    "softcap": {"logit_softcap": 2.5},
    "smoothing": {"label_smoothing": 0.1},
    "z-loss": {"z_loss": 1e-2},
    "everything": {"bias": True, "logit_scale": 1.3, "logit_softcap": 4.0, "label_smoothing": 0.2, "z_loss": 1e-3},
}


def case_inputs(case, seed=0, dtype=torch.float32, rows=ROWS):
    kw = dict(CASES[case])
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, VOCAB, generator=g) * 3).to(dtype)
    y = torch.randint(0, VOCAB, (rows,), generator=g)
    w = torch.rand(rows, generator=g) + 0.5
    w[::4] = 0.0  # ignored rows: weight 0, a gradient of exactly 0
    z[5, 17] = z[5, 150] = z[5].max() + 1  # a tie for the maximum in two tiles: torch.argmax takes the first
    y[5] = 150
    z[6, 17] = z[6, 150] = z[6].max() + 1
    y[6] = 17
    bias = torch.randn(VOCAB, generator=g) if kw.pop("bias", False) else None
    return z, y, w, bias, kw


# One row per program (a GPU's launch) with every option at once; 16 rows per program (the interpreter's) per option
LAUNCHES = [("everything", (1, 128, 4))] + [(case, (16, 128, 1)) for case in CASES]


@pytest.mark.parametrize("case,shape", LAUNCHES, ids=[f"{c}-{'gpu' if s[0] == 1 else 'interpreter'}-launch"
                                                      for c, s in LAUNCHES])
def test_the_kernel_matches_float64_from_the_same_logits(case, shape):
    z, y, w, bias, kw = case_inputs(case, rows=ROWS if shape[0] > 1 else 9)  # a program a row: fewer (the time)
    got = run_kernel(z, y, w, bias, shape, **kw)
    err = errors(got, reference(z, y, w, bias, **kw))
    assert max(err.values()) < 2e-5, err
    assert got[2][::4].abs().max() == 0  # ignored rows: exactly 0
    if bias is None:  # (a bias breaks the tie)
        assert got[3][5] == 0 and got[3][6] == 1  # the tie: the first maximum is the argmax


def test_the_kernel_writes_its_gradient_in_the_blocks_dtype():
    """A bf16 block (what the GEMM gives on a GPU): read in float32, the gradient written back in bf16, rounded to
    the nearest (within half an ulp, 2**-8 relative at most, of float64's from the same bf16 logits)."""
    z, y, w, bias, kw = case_inputs("everything", dtype=torch.bfloat16)
    got = run_kernel(z, y, w, bias, (16, 128, 1), **kw)
    want = reference(z, y, w, bias, **kw)
    assert got[2].dtype == torch.bfloat16
    assert ((got[2].double() - want[2]).abs() <= 2**-8 * want[2].abs() + 1e-6 * want[2].abs().max()).all()
    # float64's rounded to bf16, but where float32's own error crosses a rounding boundary (a truncation: half differ)
    assert (got[2] != want[2].to(torch.bfloat16)).float().mean() < 0.01
    err = errors(got, want)
    assert err["loss"] < 2e-5 and err["lse"] < 2e-5, err


def mutant(tmp_path, find: str, replace: str):
    """The kernel's module with one change to its source, imported from its own file (Triton reads the source)."""
    text = SOURCE.read_text()
    assert text.count(find) == 1, find
    path = tmp_path / f"mutant_{abs(hash((find, replace)))}.py"
    path.write_text(text.replace(find, replace))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


# (the kernel's line, its mutation, the case whose check must catch it, what must be off)
MUTANTS = [
    ("s = s * keep + tl.sum(e, 1)", "s = s + tl.sum(e, 1)", "plain", "loss"),  # the online rescale dropped
    ("x = tl.where(ok, x, _NEG)\n        top", "x = tl.where(row_ok[:, None], x, _NEG)\n        top", "plain", "lse"),  # the last tile's
    # columns past the vocabulary counted
    ("x = (z + bias) * scale", "x = z + bias", "scale", "loss"),
    ("                d *= 1.0 - t * t", "                d *= 1.0", "softcap", "dlogits"),
    ("loss += eps * (lse - z_sum / vocab)", "loss += eps * (lse - z_sum)", "smoothing", "loss"),
    ("factor = w * (1.0 + 2.0 * z_loss * lse)", "factor = w * (1.0 + z_loss * lse)", "z-loss", "dlogits"),
    ("best = tl.where(top > m, first, best)", "best = tl.where(top >= m, first, best)", "plain", "hit"),
    ("tl.store(ent_ptr + rows, lse - px / s, mask=row_ok)", "tl.store(ent_ptr + rows, lse - px, mask=row_ok)",
     "plain", "entropy"),
    ("b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]\n            x, t =",
     "b = 0.0\n            x, t =", "bias", "dlogits"),
]


@pytest.mark.parametrize("find,replace,case,field", MUTANTS, ids=[f"{m[2]}-{m[3]}" for m in MUTANTS])
def test_each_check_fails_when_the_kernel_is_wrong(tmp_path, find, replace, case, field):
    impl = mutant(tmp_path, find, replace)
    z, y, w, bias, kw = case_inputs(case)
    err = errors(run_kernel(z, y, w, bias, (16, 128, 1), impl=impl, **kw), reference(z, y, w, bias, **kw))
    assert err[field] > 1e-3, err  # the check above (< 2e-5) would fail


def test_the_rounding_check_fails_when_the_kernel_truncates(tmp_path):
    """Without its own rounding the kernel's bf16 gradient is the interpreter's truncation: most elements differ."""
    impl = mutant(tmp_path, "d = _round_nearest_even_bf16(d)", "d = d")
    z, y, w, bias, kw = case_inputs("everything", dtype=torch.bfloat16)
    got = run_kernel(z, y, w, bias, (16, 128, 1), impl=impl, **kw)
    assert (got[2] != reference(z, y, w, bias, **kw)[2].to(torch.bfloat16)).float().mean() > 0.2


def rounded(h, w, y, dtype, **kw):
    """float64 from the inputs rounded to ``dtype`` and the head's product rounded to it once (as the model's own
    head gives it): the loss and the gradients of the hidden states and the weight."""
    hq, wq = h.to(dtype).double().requires_grad_(), w.to(dtype).double().requires_grad_()
    z = hq @ wq.t()
    z = z + (z.to(dtype).double() - z).detach()
    loss = F.cross_entropy(z, y, ignore_index=-100, label_smoothing=kw.get("label_smoothing", 0.0))
    loss.backward()
    return loss.detach(), hq.grad, wq.grad


def path_errors(policy, chunk_size, path="fused", **kw):
    g = torch.Generator().manual_seed(1)
    n, hdim, v = 96, 24, 200
    h, w = torch.randn(n, hdim, generator=g, dtype=torch.float64), torch.randn(v, hdim, generator=g,
                                                                                  dtype=torch.float64) * 0.4
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    ref, gh, gw = rounded(h, w, y, torch.bfloat16, **kw)
    hb, wb = h.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
    chosen = function.choose_path
    function.choose_path = lambda *a: path
    try:
        loss = chunked_cross_entropy(hb, wb, y, chunk_size=chunk_size, accuracy=policy, **kw)
    finally:
        function.choose_path = chosen
    loss.backward()
    assert loss.dtype == torch.float32
    return {"loss": abs(float(loss.detach()) - float(ref)) / float(ref),
            "dh": float((hb.grad.double() - gh).norm() / gh.norm()),
            "dw": float((wb.grad.double() - gw).norm() / gw.norm()),
            "ignored_dh": float(hb.grad[::7].abs().max())}


def test_the_public_function_takes_the_fused_path_where_the_kernel_runs(monkeypatch):
    assert function.choose_path("cpu", torch.bfloat16, "mean") == "fused"  # the interpreter: the kernel runs
    assert function.choose_path("cpu", torch.float32, "mean") == "chunked"
    assert function.choose_path("cpu", torch.bfloat16, "none") == "chunked"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert function.choose_path("cpu", torch.bfloat16, "sum") == "blocked"  # a CPU keeps today's paths
    assert function.choose_path("meta", torch.bfloat16, "sum") == "blocked"


@pytest.mark.parametrize("kw", [{"label_smoothing": 0.1}], ids=["smoothing"])
def test_both_policies_match_float64_and_accurate_rounds_once(kw):
    """8 chunks of 12 rows. ``accurate``: the blocked path's error (each element of dW one float32 sum rounded once);
    ``compact``: dW accumulated in bf16 chunk by chunk, a few roundings more, still within bf16's reach."""
    blocked = path_errors(None, 12, path="blocked", **kw)
    accurate = path_errors("accurate", 12, **kw)
    compact = path_errors("compact", 12, **kw)
    for name, err in (("blocked", blocked), ("accurate", accurate), ("compact", compact)):
        assert err["loss"] < 1e-5 and err["ignored_dh"] == 0, (name, err)
        assert err["dh"] < 1e-2 and err["dw"] < 2e-2, (name, err)
    assert accurate["dw"] <= 1.25 * blocked["dw"], (accurate, blocked)
    assert compact["dw"] > accurate["dw"], (compact, accurate)  # the policies differ where they say they do


def test_a_wrong_accuracy_is_refused_with_the_choices():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=re.escape("accuracy='fast': use one of 'compact', 'accurate'")):
        chunked_cross_entropy(h, w, y, accuracy="fast")


def test_statistics_and_the_count_on_the_fused_path():
    """The statistics the TRL entry logs and a Trainer's count, through the fused path, as the blocked path gives."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(40, 16, generator=g).bfloat16(), (torch.randn(90, 16, generator=g) * 0.5).bfloat16()
    y = torch.randint(0, 90, (40,), generator=g)
    y[::3] = -100
    out = {}
    for path in ("fused", "blocked"):
        chosen = function.choose_path
        function.choose_path = lambda *a: path
        try:
            loss, stats = chunked_cross_entropy_with_stats(h, w, y, num_items_in_batch=57, chunk_size=8)
        finally:
            function.choose_path = chosen
        out[path] = (float(loss), int(stats.num_correct), float(stats.entropy_sum), int(stats.num_valid))
    assert out["fused"][1:] == pytest.approx(out["blocked"][1:], rel=1e-5), out
    assert out["fused"][0] == pytest.approx(out["blocked"][0], rel=1e-5), out
