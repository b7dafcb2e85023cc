"""trl-chunked-nll-zero3 and trl-chunked-nll-gather-zero3: TRL's chunked_nll under ZeRO-3, real runs.

2 ranks, as ``accelerate launch`` runs them (its variables, in one batch of runs) with a ZeRO-3 config (``zero3_init_flag: true``, every parameter partitioned),
a tiny Llama saved locally and loaded by ``SFTTrainer`` with ``from_pretrained``, AdamW, 3 steps.

- R1 (stack trl151-ds0154: trl 1.5.1, deepspeed 0.15.4): ``eval_on_start=True``; the evaluation runs the
  model outside ``engine.forward``, where DeepSpeed < 0.16 does not gather ``lm_head.weight``.
- R2 (any DeepSpeed; trl 1.5.1 on trl151-ds0154 and 2026-04): a ``compute_loss`` that runs ``model.model``
  and then TRL's chunked loss on ``lm_head.weight``.

Unpatched, both crash where measured (so a stack that stops crashing is noticed). Patched, the train
losses, grad norms and eval losses equal the same run with ``loss_type="nll"`` (full logits). On ``latest``
(trl 1.16) the entry is not-affected, and R2 written against ``zerofix.chunked_cross_entropy`` equals nll.

trl 1.6.0 - 1.14.2 (stacks trl160, trl1100, trl1142: the ends of the range and one inside) gather the head
once per chunk. With ``assistant_only_loss=True`` rank 0 counts 8 tokens per step (1 chunk) and rank 1 24 (3):
- R4, the compute_loss override (the head is not whole there): unpatched the ranks run different numbers of
  gathers and hang (bounded: three times the patched run's time, then every rank is killed); patched, equal to
  the full-logits run, with 2 gathers of the head per step on every rank whatever its chunk count.
- R3, the Trainer's own step: measured on CPU with DeepSpeed 0.18.9 and 0.19.8, the head stays whole through
  the step, TRL gathers it the same number of times on every rank and nothing hangs; there zerofix must change
  nothing: unpatched and patched both equal the full-logits run and gather the head as often.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from conftest import uses  # noqa: E402
from zerofix.check import builders, launch  # noqa: E402

pytestmark = pytest.mark.distributed
R1_STACK = "trl151-ds0154"
GATHER_STACKS = ("trl160", "trl1100", "trl1142")  # trl 1.6.0, 1.10.0, 1.14.2
GATHER = "trl-chunked-nll-gather-zero3"
SAME = 1e-5  # relative: float32, chunked sums in another order than the full logits


def sft(path, loss_type, *, zerofix=False, loss_fn="trl", **options):
    """SFTTrainer under ZeRO-3 on 2 ranks, as accelerate launch runs it (the tiny Llama made by the first run that
    needs it, in the batch's folder)."""
    args = ["--model-dir", "{root}/tiny-llama", "--path", path, "--loss-type", loss_type, "--loss-fn", loss_fn]
    name = f"sft-{path}-{loss_type}-{loss_fn}-{'patched' if zerofix else 'unpatched'}"
    return builders.trl_request(builders.TRL_SFT, name, args + (["--zerofix"] if zerofix else []), nproc=2, timeout=400,
                            **options)


def records(ranks, request) -> list[dict]:
    got = ranks.records(request)
    assert len(got) == 2
    for r in got:
        if "error" not in r:
            assert r["facts"] == {"zero3": True, "head_numel_after_load": 0, "head_is_zero3_param": True}
    return got


def assert_same_training(got: list[dict], ref: list[dict]):
    for g, r in zip(got, ref, strict=True):
        assert "error" not in g, g.get("traceback")
        for key in ("train_loss", "grad_norm", "eval_loss"):
            assert len(g[key]) == len(r[key]), key
            for a, b in zip(g[key], r[key], strict=True):
                assert abs(a - b) <= SAME * abs(b), (key, g[key], r[key])
        assert len(g["train_loss"]) == 3 and len(g["grad_norm"]) == 3


def r1():
    return [sft("r1", "nll"), sft("r1", "chunked_nll", late=True), sft("r1", "chunked_nll", zerofix=True)]


@pytest.mark.stack(R1_STACK)
@uses(r1)
def test_r1_eval_on_start_crashes_unpatched_and_trains_like_nll_patched(ranks):
    ref, crashed, patched = (records(ranks, r) for r in r1())
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    assert all(len(r["eval_loss"]) == 3 for r in ref)  # on start, at step 2 and at the end
    for r in crashed:
        assert r["status"]["trl-chunked-nll-zero3"] == "inactive"  # in range, not enabled
        assert r["error"].startswith("RuntimeError: in eval forward") and "size mismatch" in r["error"], r["error"]
        assert "vec (0)" in r["error"]
    assert all(r["status"]["trl-chunked-nll-zero3"] == "applied" for r in patched)
    assert_same_training(patched, ref)


def r2():
    return [sft("r2", "nll"), sft("r2", "chunked_nll", late=True), sft("r2", "chunked_nll", zerofix=True)]


@pytest.mark.stack(R1_STACK, "2026-04")
@uses(r2)
def test_r2_compute_loss_override_crashes_unpatched_and_trains_like_nll_patched(ranks):
    ref, crashed, patched = (records(ranks, r) for r in r2())
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    for r in crashed:
        assert r["error"].startswith("RuntimeError: in train forward") and "size mismatch" in r["error"], r["error"]
    assert_same_training(patched, ref)


def assert_uneven_chunks(records):
    """Rank 0 counts 8 tokens per step (1 chunk of 8), rank 1 24 (3 chunks)."""
    counted = [[s["counted_tokens"] for s in r["steps"]] for r in records]
    assert counted == [[8] * 3, [24] * 3], counted


def processes_under(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (the ranks of a launch write there)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return [pid for pid in found if pid != os.getpid()]


def r4():
    """The reference, the patched run, then (last) the unpatched one with a limit of 10 x the patched run's time, at
    least 10 s (the patched run takes about 1 s; the check's own row gives a user's machine at least 30 s)."""
    patched = sft("r4", "chunked_nll", zerofix=True)
    return [sft("r4", "nll"), patched, sft("r4", "chunked_nll", late=True, bound=(patched, 10, 10.0))]


@pytest.mark.stack(*GATHER_STACKS)
@uses(r4)
def test_r4_uneven_chunks_hang_unpatched_and_train_like_full_logits_patched(ranks):
    ref_request, patched_request, unpatched_request = r4()
    ref, patched = records(ranks, ref_request), records(ranks, patched_request)
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    assert all(r["status"][GATHER] == "applied" for r in patched)
    assert_uneven_chunks(patched)
    assert_same_training(patched, ref)
    # one gather in forward, one in backward, on every rank and step, whatever the chunk count
    assert all(s["head_gathers"] == 2 for r in patched for s in r["steps"]), [r["steps"] for r in patched]
    with pytest.raises(launch.LaunchError, match="timed out"):
        ranks.records(unpatched_request)
    # the hung ranks were killed (their session's plan is under the batch's folder), and their DeepSpeed segments
    # removed (a stale one stalls a later session given the same port)
    assert processes_under(ranks.root) == []
    for master in ranks.root.glob("session-*/launch*/master.json"):
        group = json.loads(master.read_text())
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer*_{group['MASTER_ADDR']}_{group['MASTER_PORT']}_*"))


def r3():
    return [sft("r3", "nll", loss_fn="full-logits"), sft("r3", "chunked_nll"), sft("r3", "chunked_nll", zerofix=True)]


@pytest.mark.stack("trl160", "trl1142")
@uses(r3)
def test_r3_trainer_step_is_unchanged_by_the_fix(ranks):
    ref, unpatched, patched = (records(ranks, r) for r in r3())
    assert all(r["status"][GATHER] == "applied" for r in patched)
    for got in (unpatched, patched):
        assert_uneven_chunks(got)
        assert_same_training(got, ref)
    gathers = [[[s["head_gathers"] for s in r["steps"]] for r in got] for got in (unpatched, patched)]
    assert gathers[0] == gathers[1] and gathers[0][0] == gathers[0][1], gathers


def r2_zerofix_loss():
    return [sft("r2", "nll", zerofix=True), sft("r2", "chunked_nll", zerofix=True, loss_fn="zerofix")]


@pytest.mark.stack("latest")
@uses(r2_zerofix_loss)
def test_latest_entry_not_affected_and_r2_on_zerofix_loss_trains_like_nll(ranks):
    ref, got = (records(ranks, r) for r in r2_zerofix_loss())
    assert all(r["status"]["trl-chunked-nll-zero3"] == "not-affected" for r in ref)
    assert all(r["status"][GATHER] == "not-affected" for r in ref)
    assert_same_training(got, ref)
