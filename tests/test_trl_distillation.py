"""trl-distillation-chunked-gather-zero3: TRL's DistillationTrainer under ZeRO-3, real runs.

2 ranks, as ``accelerate launch`` runs them (its variables, in one batch of runs) with a ZeRO-3 config (``zero3_init_flag: true``), a tiny student and a tiny teacher
saved locally (both partitioned), on-policy generation (no vLLM), the Trainer's own step, 3 steps, beta 0.5.
Completions end at EOS (made likely), so the ranks count different numbers of completion tokens; with 4 rows per
chunk their chunk counts differ in step 3 (6 and 4 chunks on trl 1.10.0, measured; the test asserts that some step
differs). TRL 1.10.0 - 1.14.2 gather the teacher's head once per chunk and again per recomputed chunk:

- unpatched, the ranks' collectives stop matching at the first uneven step: gloo aborts ("collective mismatch");
  the test allows a hang too (what NCCL does), bounded at three times the patched run;
- patched, train losses and grad norms equal the reference within 1e-5 relative, and every rank gathers the
  teacher's head once per step and the student's as often as every other rank, whatever its chunk count.

The reference is the unpatched run with chunks larger than any rank's token count: one chunk per rank, the full
logits of the counted tokens, the same number of gathers on every rank (TRL's own computation, which cannot hang).
Without ZeRO-3 the wrapper hands TRL's function through untouched: bitwise the same results.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from conftest import uses  # noqa: E402
from zerofix.check import builders, launch  # noqa: E402
from zerofix.check.scenarios import trl_distill  # noqa: E402

STACKS = ("trl1100", "trl1142")  # trl 1.10.0 and 1.14.2: the ends of the range
FIX_ID = "trl-distillation-chunked-gather-zero3"
SAME = 1e-5


def distill(variant, chunk, *, zerofix=False, **options):
    """DistillationTrainer under ZeRO-3 on 2 ranks, as accelerate launch runs it (student and teacher made by the
    first run that needs them, in the batch's folder)."""
    args = ["--student", "{root}/distill/student", "--teacher", "{root}/distill/teacher", "--chunk", str(chunk)]
    return builders.trl_request(builders.TRL_DISTILL, f"distill-{variant}", args + (["--zerofix"] if zerofix else []),
                            nproc=2, timeout=400, **options)


def uneven():
    """The one-chunk reference, the patched run, then (last) the unpatched one, limited to 10 x the patched run (at
    least 10 s; see test_trl_chunked_nll.r4)."""
    patched = distill("patched", trl_distill.CHUNK, zerofix=True)
    return [distill("reference", trl_distill.WHOLE), patched,
            distill("unpatched", trl_distill.CHUNK, late=True, bound=(patched, 10, 10.0))]


def assert_same_training(got, ref):
    for g, r in zip(got, ref, strict=True):
        assert "error" not in g, g.get("traceback")
        assert g["facts"] == {"zero3": True, "heads_are_zero3_params": True}
        assert [s["completion_tokens"] for s in g["steps"]] == [s["completion_tokens"] for s in r["steps"]]
        for key in ("train_loss", "grad_norm"):
            assert len(g[key]) == len(r[key]) == 3, key
            for a, b in zip(g[key], r[key], strict=True):
                assert abs(a - b) <= SAME * abs(b), (key, g[key], r[key])


@pytest.mark.distributed
@pytest.mark.stack(*STACKS)
@uses(uneven)
def test_uneven_chunks_break_unpatched_and_train_like_one_chunk_patched(ranks):
    ref_request, patched_request, unpatched_request = uneven()
    ref, patched = ranks.records(ref_request), ranks.records(patched_request)
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    assert all(r["status"][FIX_ID] == "inactive" for r in ref)  # in range, not enabled
    assert all(r["status"][FIX_ID] == "applied" for r in patched)
    assert_same_training(patched, ref)
    chunks = [[s["chunks"] for s in r["steps"]] for r in patched]
    assert chunks[0] != chunks[1], chunks  # some step has different chunk counts on the ranks
    for step in zip(*(r["steps"] for r in patched)):
        assert [s["teacher_head_gathers"] for s in step] == [1, 1], step
        assert step[0]["student_head_gathers"] == step[1]["student_head_gathers"] <= 2, step
    try:
        broken = ranks.records(unpatched_request)
    except launch.LaunchError as exc:
        message = f"{exc}\n{exc.tail}"
        assert "collective mismatch" in message or "timed out" in message, message[-3000:]
    else:
        pytest.fail(f"the unpatched run with uneven chunks finished: {[r.get('error') for r in broken]}")


@pytest.mark.stack(*STACKS)
def test_without_zero3_the_wrapper_hands_trl_its_own_function():
    import torch

    import zerofix
    from trl.trainer import distillation_trainer as dt

    def call():
        g = torch.Generator().manual_seed(0)
        h_s = torch.randn(2, 9, 8, generator=g, requires_grad=True)
        w_s = torch.randn(16, 8, generator=g, requires_grad=True)
        h_t, w_t = torch.randn(2, 9, 6, generator=g), torch.randn(16, 6, generator=g)
        mask = (torch.rand(2, 9, generator=g) > 0.3).long()
        loss, entropy, n = dt._chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, 0.5, 4, num_items_in_batch=None,
                                                       temperature=2.0)
        loss.backward()
        return [loss.detach(), entropy.detach(), n, h_s.grad, w_s.grad]

    raw = call()
    try:
        zerofix.patch([FIX_ID])
        assert {r.id: r.state for r in zerofix.status()}[FIX_ID] == "applied"
        wrapped = call()
    finally:
        zerofix.unpatch([FIX_ID])
    assert all(torch.equal(a, b) for a, b in zip(raw, wrapped, strict=True))
