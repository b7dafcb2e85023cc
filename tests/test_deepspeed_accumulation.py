"""deepspeed-manual-accumulation, measured with real DeepSpeed engines on 2 gloo ranks.

One torchrun job per stack runs every loop of zerofix.check.accumulation (ZeRO 0/1/2/2+overlap/3 x
config GAS {1, 4} x loop styles a-e x SGD/AdamW, plus a short last window and a checkpoint resumed at a
window boundary), first without zerofix, then patched. Each cell's parameters after each of its windows
are compared with a float64 single-process reference trained on the same samples.

Unpatched, every cell must show what DeepSpeed is known to do on this release (``known_unpatched``:
last micro-batch only, silent no-op, or correct), so a stack that stops showing a bug is noticed.
Patched, every cell must equal the reference.
"""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from zerofix import catalogue, patching
from zerofix.check import accumulation, parity, reference
from zerofix.check.accumulation import CORRECT, ERROR

FIX = "deepspeed-manual-accumulation"
STACKS = ("latest", "2026-04", "2025-12", "2025-10", "2025-01")
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-5}  # relative error of the update, fp32 run vs fp64 reference
CELLS = accumulation.matrix() + accumulation.extra_cells()
pytestmark = [pytest.mark.distributed, pytest.mark.stack(*STACKS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return parity.ds_accumulation(tmp_path_factory.mktemp("ds-accumulation"), CELLS, nproc=2)


_references: dict = {}


def expected(runs, cell, semantics):
    """Reference snapshots and update norms for the cell's loop under ``semantics``."""
    key = (cell.gas, cell.style, cell.optimizer, cell.clip, semantics)
    if key not in _references:
        _references[key] = reference.reference_windows(
            runs["init"], accumulation.updates(cell, semantics), world=runs["world"],
            optimizer_factory=reference.OPTIMIZERS[cell.optimizer], clip=cell.clip)
    return _references[key]


def errors(runs, variant, cell, semantics):
    snapshots, _ = expected(runs, cell, semantics)
    return parity.window_errors(runs["init"], runs[variant][cell.name]["snapshots"], snapshots)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_unpatched_shows_what_deepspeed_is_known_to_do(runs, cell):
    known = accumulation.known_unpatched(cell, metadata.version("deepspeed"))
    raised = runs["unpatched"][cell.name]["errors"]
    if known == ERROR:  # 0.17.6-0.18.2: the second boundary backward before step() zips over None
        assert all(e and e.startswith("TypeError") for e in raised), raised
        return
    assert raised == [None] * runs["world"], raised
    # An over-divided update is GAS or GAS**2 times smaller, its fp32 noise as many times larger relatively.
    tolerance = TOLERANCE[cell.optimizer] * cell.gas ** accumulation.EXTRA_DIVISIONS.get(known, 0)
    assert max(errors(runs, "unpatched", cell, known)) < tolerance, known
    if known != CORRECT:  # and it is really wrong, not just within tolerance of right
        assert max(errors(runs, "unpatched", cell, CORRECT)) > 0.1
    assert all(r["state"] == "inactive" for r in runs["unpatched"][cell.name]["runtime"])


def deepspeed_fixes_applied(runtime) -> set[str]:
    return {fix for fix, state in runtime["states"].items() if state == "applied"}


# The patched runs enable every DeepSpeed fix; those whose range holds the installed release apply.
IN_RANGE = {f.id for f in catalogue.FIXES
            if f.dist == "deepspeed" and patching.version_in_range(metadata.version("deepspeed"), f.affected)}


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_patched_matches_the_reference(runs, cell):
    result = runs["patched"][cell.name]
    assert result["errors"] == [None] * runs["world"], result["errors"]
    semantics = accumulation.known_patched(cell, metadata.version("deepspeed"))
    assert max(errors(runs, "patched", cell, semantics)) < TOLERANCE[cell.optimizer], semantics
    _, norms = expected(runs, cell, semantics)
    assert not cell.clip or min(norms) > cell.clip  # clipping really acts in style (e)
    for rank_norms in result["norms"]:
        if cell.stage == 0:  # DeepSpeed reports no norm for a ZeRO-0 torch optimizer
            assert rank_norms == [None] * len(norms)
        else:
            assert rank_norms == pytest.approx(norms, rel=1e-5)
    for runtime in result["runtime"]:
        assert runtime["state"] == "applied"
        assert deepspeed_fixes_applied(runtime) == IN_RANGE, runtime["states"]
        seen = runtime["engine"]
        updates = sum(len(w) for w in accumulation.updates(cell))
        if cell.resume:  # the resumed engine saw only the second window
            updates //= 2
        assert (seen["active"], seen["windows"], seen["pending"]) == (True, updates, 0), seen
        # A loop that flags its boundaries itself is left to DeepSpeed: nothing is reduced twice.
        assert seen["flushed"] == (0 if cell.style == "c" else updates), seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_resumed_at_a_window_boundary_continues_identically(runs, stage):
    resumed = runs["patched"][accumulation.Cell(stage, 1, "a", "adamw", resume=True).name]["snapshots"]
    straight = runs["patched"][accumulation.Cell(stage, 1, "a", "adamw").name]["snapshots"]
    assert max(parity.window_errors(runs["init"], resumed, straight)) < 1e-6


@pytest.mark.parametrize("stage", [1, 2])
def test_short_last_window_of_an_epoch_is_applied(runs, stage):
    cell = accumulation.Cell(stage, 1, "short")
    assert len(runs["patched"][cell.name]["snapshots"]) == 3
    last_window_error = errors(runs, "patched", cell, CORRECT)[-1]
    assert last_window_error < TOLERANCE["sgd"]


def test_scale_mismatch_is_warned_once_per_engine(runs):
    """3 backwards per step() with config GAS=4: DeepSpeed divides by 4 (kept, and said)."""
    seen = runs["patched"][accumulation.Cell(2, 4, "d").name]["runtime"][0]["engine"]
    assert seen["warnings"] == ["scale"]
    assert runs["patched"][accumulation.Cell(2, 4, "a").name]["runtime"][0]["engine"]["warnings"] == []


@pytest.mark.stack("latest", "2026-04")
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_through_deepspeed_stays_exact(tmp_path, stage):
    """Accelerate's DeepSpeedEngineWrapper flags the boundary itself: zerofix must leave it alone."""
    result = parity.trainer_gas(tmp_path, model="causal-lm", nproc=2, gas=8,
                                extra_args=["--zero-stage", str(stage)])
    for variant in ("unpatched", "patched"):
        assert result[variant]["rel_err"] < 1e-6, (variant, result[variant])
    for runtime in result["patched"]["rank_runtime"]:
        (seen,) = runtime[FIX]
        assert (seen["zero_stage"], seen["windows"], seen["flushed"]) == (stage, 1, 0), seen


def test_environment_activation_reaches_every_rank_and_logs_once_per_engine(tmp_path):
    """ZEROFIX=1 ZEROFIX_LOG=info, a script that never calls patch(): both ranks fixed, one line each."""
    cells = [accumulation.Cell(2, 1, "a"), accumulation.Cell(1, 4, "d")]
    runs = parity.ds_accumulation(tmp_path, cells, variants=("env",),
                                  env={"ZEROFIX": "1", "ZEROFIX_LOG": "info"})
    for cell in cells:
        result = runs["env"][cell.name]
        assert [r["state"] for r in result["runtime"]] == ["applied", "applied"]
        assert max(errors(runs, "env", cell, CORRECT)) < TOLERANCE["sgd"]
    log = (tmp_path / "launcher.log").read_text()
    for rank in (0, 1):
        active = [line for line in log.splitlines()
                  if line.startswith(f"[zerofix rank {rank}] INFO {FIX}: active on a DeepSpeed engine")]
        assert len(active) == len(cells), log[-3000:]
    assert f"[zerofix rank 0] WARNING {FIX}: DeepSpeed divided each loss of this 3-micro-batch window" in log


def test_the_flush_communicates_exactly_what_a_boundary_backward_does(tmp_path):
    """benchmarks/bench_deepspeed_accumulation.py counts every torch.distributed collective (calls and
    elements) of one window; zerofix's lazy boundary must match DeepSpeed's own boundary on every stage.
    The timings it also prints are the benchmark's business, not this test's."""
    import json
    import subprocess
    import sys

    from zerofix.check.launch import scenario_env

    out = tmp_path / "bench.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deepspeed_accumulation.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(bench), str(out)], env=scenario_env({"BENCH_CALLS": "500", "BENCH_WINDOWS": "1"}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage, rows in json.loads(out.read_text())["collectives"].items():
        boundary, lazy, _unpatched = rows.values()
        assert lazy == boundary, (stage, rows)
        assert sum(boundary["calls"].values()) > 0
