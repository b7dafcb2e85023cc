"""trl-chunked-nll-zero3: TRL's chunked_nll under ZeRO-3 on the two paths that crash, real runs.

2 ranks, ``accelerate launch`` with a ZeRO-3 config (``zero3_init_flag: true``, every parameter partitioned),
a tiny Llama saved locally and loaded by ``SFTTrainer`` with ``from_pretrained``, AdamW, 3 steps.

- R1 (stack trl151-ds0154: trl 1.5.1, deepspeed 0.15.4): ``eval_on_start=True``; the evaluation runs the
  model outside ``engine.forward``, where DeepSpeed < 0.16 does not gather ``lm_head.weight``.
- R2 (any DeepSpeed; trl 1.5.1 on trl151-ds0154 and 2026-04): a ``compute_loss`` that runs ``model.model``
  and then TRL's chunked loss on ``lm_head.weight``.

Unpatched, both crash where measured (so a stack that stops crashing is noticed). Patched, the train
losses, grad norms and eval losses equal the same run with ``loss_type="nll"`` (full logits). On ``latest``
(trl 1.16) the entry is not-affected, and R2 written against ``zerofix.chunked_cross_entropy`` equals nll.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from zerofix.check import jobs, launch  # noqa: E402
from zerofix.check.scenarios import trl_sft  # noqa: E402

pytestmark = pytest.mark.distributed
R1_STACK = "trl151-ds0154"
SAME = 1e-5  # relative: float32, chunked sums in another order than the full logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trl_sft.make_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def sft(tmp_path, model_dir):
    def run(path, loss_type, *, zerofix=False, loss_fn="trl"):
        name = f"{path}-{loss_type}-{loss_fn}-{'patched' if zerofix else 'unpatched'}"
        args = ["--model-dir", str(model_dir), "--path", path, "--loss-type", loss_type, "--loss-fn", loss_fn]
        records = launch.accelerate_launch(jobs.TRL_SFT, args + (["--zerofix"] if zerofix else []),
                                           config=jobs.trl_accelerate_config(tmp_path), nproc=2,
                                           out_dir=tmp_path / name, timeout=400)
        assert len(records) == 2
        for r in records:
            if "error" not in r:
                assert r["facts"] == {"zero3": True, "head_numel_after_load": 0, "head_is_zero3_param": True}
        return records
    return run


def assert_same_training(got: list[dict], ref: list[dict]):
    for g, r in zip(got, ref, strict=True):
        assert "error" not in g, g.get("traceback")
        for key in ("train_loss", "grad_norm", "eval_loss"):
            assert len(g[key]) == len(r[key]), key
            for a, b in zip(g[key], r[key], strict=True):
                assert abs(a - b) <= SAME * abs(b), (key, g[key], r[key])
        assert len(g["train_loss"]) == 3 and len(g["grad_norm"]) == 3


@pytest.mark.stack(R1_STACK)
def test_r1_eval_on_start_crashes_unpatched_and_trains_like_nll_patched(sft):
    ref = sft("r1", "nll")
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    assert all(len(r["eval_loss"]) == 3 for r in ref)  # on start, at step 2 and at the end
    crashed = sft("r1", "chunked_nll")
    for r in crashed:
        assert r["status"]["trl-chunked-nll-zero3"] == "inactive"  # in range, not enabled
        assert r["error"].startswith("RuntimeError: in eval forward") and "size mismatch" in r["error"], r["error"]
        assert "vec (0)" in r["error"]
    patched = sft("r1", "chunked_nll", zerofix=True)
    assert all(r["status"]["trl-chunked-nll-zero3"] == "applied" for r in patched)
    assert_same_training(patched, ref)


@pytest.mark.stack(R1_STACK, "2026-04")
def test_r2_compute_loss_override_crashes_unpatched_and_trains_like_nll_patched(sft):
    ref = sft("r2", "nll")
    assert all("error" not in r for r in ref), ref[0].get("traceback")
    crashed = sft("r2", "chunked_nll")
    for r in crashed:
        assert r["error"].startswith("RuntimeError: in train forward") and "size mismatch" in r["error"], r["error"]
    patched = sft("r2", "chunked_nll", zerofix=True)
    assert_same_training(patched, ref)


@pytest.mark.stack("latest")
def test_latest_entry_not_affected_and_r2_on_zerofix_loss_trains_like_nll(sft):
    ref = sft("r2", "nll", zerofix=True)
    assert all(r["status"]["trl-chunked-nll-zero3"] == "not-affected" for r in ref)
    got = sft("r2", "chunked_nll", zerofix=True, loss_fn="zerofix")
    assert_same_training(got, ref)
