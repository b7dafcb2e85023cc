"""The Trainer under DeepSpeed Ulysses sequence parallelism (issue 61): the window's token mean, on ZeRO-0..3.

Real Trainer, real DeepSpeed Ulysses (``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)``),
2 gloo ranks (one SP group) and 4 (sp 2 x dp 2), one SGD step of a tiny Llama in fp32 through
``zerofix.check.scenarios.sequence_parallel``: samples of 32 tokens with uneven counted labels, sample 0's second shard holding
none. Every cell is compared with a float64 reference computed by hand in rank 0 on the samples the step trained on
(read from the ranks' collators): the gradient of the window's token mean, and of the mean of micro-batch means.

Unpatched, each cell asserts the factor measured on its stack. On latest (5.24): sp_size x the micro-batch mean on
ZeRO-0/1/2 (its reduction divides the sum over SP ranks by world / sp), right on ZeRO-3 at one micro-batch, the mean of
micro-batch means at GA 2 (x2 on ZeRO-0/1/2), x4 / x2 with a compute_loss_func, which is never called; on 4 gloo ranks
upstream stops in the backward of its loss's ``all_gather`` ("Global rank 0 is not part of group"). On 2025-12 (5.0):
the same at GA 1, 0.5 x the mean of means at GA 2. On 2026-04 (5.3 with accelerate 1.13) every SP step stops at its
first loss, unpatched and patched. Patched, every cell is the window's token mean (relative error of the update under
1e-6); where upstream is right (ZeRO-3, one micro-batch, one SP group), or zerofix stands aside (ZeRO-3 without
reduce-scatter, a compute_loss adding a term), the update is bitwise upstream's on latest.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerofix.check.host.env import scenario_env

pytestmark = pytest.mark.distributed
SP_STACKS = ("latest", "2025-12")  # transformers >= 5.0 with accelerate >= 1.12: the path exists (2026-04: below)
EXACT = 1e-6
ENTRY = "transformers-deepspeed-sp-loss"

# (cell, the reference the unpatched update is a multiple of, that multiple on latest / on 2025-12), measured. 5.24 passes
# scale_wrt_gas=False and DeepSpeed 0.19.8 honours it: the SP factor shows (x2 on ZeRO-0/1/2, and x2 again where a
# compute_loss_func makes the Trainer skip its division). 5.0 with DeepSpeed 0.18.3 divides by GA again (0.18.3 ignores
# scale_wrt_gas=False, and its output hooks divide): 0.5 x the mean of means at GA 2 on every stage.
TWO_RANKS = [
    ({"zero": 1, "gas": 1, "bs": 2}, "token", {"latest": 2.0, "2025-12": 2.0}),
    ({"zero": 2, "gas": 1, "bs": 2}, "token", {"latest": 2.0, "2025-12": 2.0}),
    ({"zero": 3, "gas": 1, "bs": 2}, "token", {"latest": 1.0, "2025-12": 1.0}),
    ({"zero": 0, "gas": 2}, "means", {"latest": 2.0, "2025-12": 0.5}),
    ({"zero": 1, "gas": 2}, "means", {"latest": 2.0, "2025-12": 0.5}),
    ({"zero": 2, "gas": 2}, "means", {"latest": 2.0, "2025-12": 0.5}),
    ({"zero": 3, "gas": 2}, "means", {"latest": 1.0, "2025-12": 0.5}),
    ({"zero": 2, "gas": 2, "loss_func": True}, "means", {"latest": 4.0, "2025-12": 1.0}),
    ({"zero": 3, "gas": 2, "loss_func": True}, "means", {"latest": 2.0, "2025-12": 1.0}),
    # not modelled: zerofix's SP entry stands aside (on 2025-12 deepspeed-scale-wrt-gas, DeepSpeed 0.19's own
    # handling of scale_wrt_gas=False, still acts: 2.0 x the mean of means patched, as latest's upstream)
    ({"zero": 3, "gas": 2, "reduce_scatter": False}, "means", {"latest": 2.0, "2025-12": 1.0}),
    # a subclass whose compute_loss adds a term to the base loss: not a loss zerofix read; upstream's run, said
    ({"zero": 2, "gas": 2, "added_term": True}, None, {"latest": None}),
    # label smoothing (issue 69, item 4): upstream's SP loss never calls the label smoother (2x the unsmoothed mean of
    # means); zerofix trains the unsmoothed token mean and says that the smoothing is not applied
    ({"zero": 2, "gas": 2, "smoothing": 0.1}, "means", {"latest": 2.0}),
]
# the other stacks: one cell of each kind (CI time); latest runs them all and the 4-rank layout
SHORT = [0, 2, 5, 7, 9]
FOUR_RANKS = [{"zero": 1, "gas": 2}, {"zero": 2, "gas": 2}, {"zero": 3, "gas": 2}, {"zero": 1, "gas": 1, "bs": 2},
              {"zero": 2, "gas": 1, "bs": 2}, {"zero": 3, "gas": 1, "bs": 2}, {"zero": 2, "gas": 2, "loss_func": True},
              {"zero": 3, "gas": 2, "loss_func": True}]


def launch(tmp_path, nproc: int, cells: list[dict], variants: str) -> tuple[list[dict], list[dict], str]:
    out = tmp_path / f"sp{nproc}-{variants.replace(',', '-')}"
    # the caller's environment (zerofix's INFO lines are read below), less ZEROFIX*; DeepSpeed's CPU op in this stack's
    # own extensions folder and its ninja first, as the ranks of every other launch have them (built ahead by `make
    # warm`: torch's shared default folder was rebuilt by each stack in turn, 40 - 60 s of both cores)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))}
    ranks_env = scenario_env()
    env.update(TORCH_EXTENSIONS_DIR=ranks_env["TORCH_EXTENSIONS_DIR"], PATH=ranks_env["PATH"])
    # the ranks forked after one import (zerofix.check.forkrun, torchrun's stand-in: 9 CPU s of imports a rank saved;
    # forked ranks train as torchrun's, tests/test_session.py); a rank that stops stops the others, as under torchrun
    proc = subprocess.run([sys.executable, "-m", "zerofix.check.forkrun", str(nproc), "--import",
                           "deepspeed,transformers.trainer", "-m",
                           "zerofix.check.scenarios.sequence_parallel", "--out", str(out),
                           "--variants", variants, "--cells", json.dumps(cells)],
                          env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in (out / "result.jsonl").read_text().splitlines()] \
        if (out / "result.jsonl").exists() else []
    errors = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.error"))] if out.exists() else []
    return results, errors, proc.stdout + proc.stderr


def _key(row) -> tuple:
    return (row["zero"], row["gas"], row.get("bs", 1), bool(row.get("loss_func")), row.get("reduce_scatter", True),
            bool(row.get("added_term")), row.get("smoothing", 0.0))


@pytest.fixture(scope="module")
def two_ranks(stack, tmp_path_factory):
    rows = [TWO_RANKS[i] for i in (range(len(TWO_RANKS)) if stack == "latest" else SHORT)]
    results, errors, log = launch(tmp_path_factory.mktemp("sp"), 2, [c for c, _, _ in rows], "unpatched,patched")
    assert not errors and len(results) == 2 * len(rows), (errors, log[-6000:])
    by = {(_key(r), r["variant"]): r for r in results}
    return rows, by, log


@pytest.mark.stack(*SP_STACKS)
def test_two_ranks_unpatched_show_the_measured_factor_and_patched_the_token_mean(two_ranks, stack):
    rows, by, log = two_ranks
    for cell, against, factors in rows:
        factor = factors[stack]
        bug, fixed = by[(_key(cell), "unpatched")], by[(_key(cell), "patched")]
        where = json.dumps(cell)
        if cell.get("added_term"):  # zerofix stands aside: upstream's update, bitwise
            assert fixed["digest"] == bug["digest"], (where, fixed)
            continue
        for run in (bug, fixed):  # which engine really trained: DeepSpeed's, with an SP group of 2
            assert run["engine"]["type"] == "DeepSpeedEngine" and run["engine"]["sequence_parallel_size"] == 2, where
            assert run["engine"]["stage"] == cell["zero"], where
            assert run["loss_func_called"] == 0, where  # upstream never calls compute_loss_func on this path
        assert bug[against]["ratio"] == pytest.approx(factor, rel=1e-4), (where, bug)
        if factor == 1.0:
            assert bug[against]["rel_err"] < EXACT, (where, bug)
        if cell.get("reduce_scatter") is False:  # ZeRO-3's mixed divisions: not covered, upstream's update
            if stack == "latest":
                assert fixed["digest"] == bug["digest"], (where, fixed)
            else:
                assert fixed[against]["ratio"] == pytest.approx(2.0, rel=1e-4), (where, fixed)
            continue
        assert fixed["token"]["rel_err"] < EXACT, (where, fixed)
        if cell["zero"] == 3 and cell["gas"] == 1:  # upstream is right: left to it, bitwise
            assert fixed["digest"] == bug["digest"], (where, fixed)
        # the reference tells the two apart: the window's token mean is not the mean of micro-batch means
        if cell["gas"] > 1:
            assert abs(fixed["means"]["ratio"] - 1.0) > 0.1, (where, fixed)
    assert "not covered: DeepSpeed Ulysses sequence parallel (sp_size=2, 1 data-parallel) ZeRO-3 without " \
           "reduce_scatter" in log
    assert f"{ENTRY} acts on this run" in log
    if stack == "latest":
        assert "stands aside from here on, not covered: DeepSpeed Ulysses sequence parallel (sp_size=2, 1 " \
               "data-parallel) ZeRO-2 with a compute_loss that changes Trainer.compute_loss's loss" in log
    if any(c.get("loss_func") for c, _, _ in rows):
        assert "compute_loss_func is not called under DeepSpeed sequence parallelism" in log
    if any(c.get("smoothing") for c, _, _ in rows):
        said = [line for line in log.splitlines() if "label_smoothing_factor=0.1 is not applied under DeepSpeed "
                "sequence parallelism" in line]
        assert len(said) == 1 and "zerofix trains that unsmoothed loss at the window's token mean" in said[0], said


@pytest.mark.stack("latest")
def test_four_ranks_sp2_dp2_upstream_stops_and_patched_trains_the_token_mean(tmp_path):
    # one launch (its four ranks' start-up once): every cell patched, then upstream's run, which stops the launch
    stops = {"zero": 2, "gas": 2, "variants": ["unpatched"]}
    results, errors, log = launch(tmp_path, 4, [*FOUR_RANKS, stops], "patched")
    assert len(results) == len(FOUR_RANKS), (errors, log[-6000:])
    for run, cell in zip(results, FOUR_RANKS):
        assert run["variant"] == "patched" and run["dp"] == 2 and run["engine"]["stage"] == cell["zero"], run
        assert len(run["windows"]) == 2 * cell["gas"], run  # both data-parallel groups' micro-batches
        assert run["token"]["rel_err"] < EXACT, (cell, run)
        assert abs(run["means"]["ratio"] - 1.0) > 5e-3, (cell, run)
    # unpatched: the backward of upstream's differentiable all_gather on gloo passes a group rank where torch wants a
    # global one, on the second SP group's ranks
    assert errors and all(e["variant"] == "unpatched" for e in errors), (errors, log[-6000:])
    said = " ".join(e["error"] for e in errors)
    assert "is not part of group" in said, log[-6000:]


@pytest.mark.stack("2026-04")
def test_on_5_3_upstream_stops_before_any_loss_and_zerofix_does_too(tmp_path):
    """transformers 5.3's deepspeed_sp_compute_loss reads ``accelerator.torch_device_mesh["sp"]``, which accelerate
    1.13 never builds for DeepSpeed SP (its ``build_device_mesh`` returns None there): every SP step stops at its first
    loss, on any device. zerofix calls upstream's loss first, so it stops the same way; nothing to fix, nothing made
    worse."""
    for variant in ("unpatched", "patched"):
        results, errors, log = launch(tmp_path, 2, [{"zero": 2, "gas": 2}], variant)
        assert not results, results
        assert errors and all("'NoneType' object is not subscriptable" in e["error"]
                              and "torch_device_mesh" in e["trace"] for e in errors), (variant, errors, log[-4000:])
