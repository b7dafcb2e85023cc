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
import torch

from conftest import detect_stack, uses
from zerofix import catalogue, versions
from zerofix.check import accumulation, builders, parity, reference
from zerofix.check.accumulation import CARRIED, CORRECT, ERROR, LOST, NOOP, SPLIT, UNAVERAGED, WRONG

FIX = "deepspeed-manual-accumulation"
STACKS = ("latest", "2026-04", "2025-12", "2025-10", "2025-01")
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-5}  # relative error of the update, fp32 run vs fp64 reference


def tolerance(cell) -> float:
    """fp32: the optimizer's bound; bf16: 16 bf16 rounding units (accumulation.BF16_BOUND)."""
    return accumulation.BF16_BOUND if cell.dtype == "bf16" else TOLERANCE[cell.optimizer]

# CI time: the newest stack runs the whole matrix; the older ones run it with SGD (AdamW goes through the
# same reductions: the resumed, offload and own-style cells keep AdamW there) and bf16 where its optimizer differs
# (0.16.3), so each stack's 2-rank job stays within its share of the CI budget (docs/development.md).
STACK = detect_stack()
NEWEST = STACK == "latest"  # CI time: 2026-04 too ran AdamW's half of the matrix, the same reductions as SGD's
AMBIGUOUS = accumulation.ambiguity_cells(metadata.version("deepspeed"))  # the fix's ambiguity list as loops
TRANSPARENT = accumulation.transparency_matrix(metadata.version("deepspeed")) + [c for c in AMBIGUOUS if c.probe]
TAKEOVER = accumulation.takeover_probes(metadata.version("deepspeed"))
DIRECT = accumulation.direct_backward_cells(metadata.version("deepspeed"))
BF16 = accumulation.bf16_cells() if NEWEST or STACK == "2025-01" else []
BF16 += accumulation.bf16_accumulator_cells()  # deepspeed-bf16-boundary-reduction's range and both sides of it
BF16 += accumulation.bf16_loss_scale_cells()  # deepspeed-bf16-loss-scale's range and both sides of it
GRAD_STEP = accumulation.flat_buffer_cells()  # deepspeed-zero12-flat-buffer's range and both sides of it
MATRIX = (accumulation.matrix() if NEWEST else accumulation.matrix(optimizers=("sgd",))
          + [accumulation.Cell(stage, 1, "a", "adamw") for stage in (0, 1, 2, 3)])  # the resumed cells' twins
CELLS = list(dict.fromkeys(MATRIX + accumulation.extra_cells() + TRANSPARENT + TAKEOVER + DIRECT
                           + BF16 + accumulation.offload_cells() + AMBIGUOUS + GRAD_STEP))
pytestmark = [pytest.mark.distributed, pytest.mark.stack(*STACKS)]


MATRIX = builders.ds_request(CELLS, nproc=2)


def matrix():
    return [MATRIX]


@pytest.fixture(scope="module")
def runs(ranks):
    return ranks.result(MATRIX)


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
@uses(matrix)
def test_unpatched_shows_what_deepspeed_is_known_to_do(runs, cell):
    known = accumulation.known_unpatched(cell, metadata.version("deepspeed"))
    raised = runs["unpatched"][cell.name]["errors"]
    if known == ERROR:  # 0.17.6-0.18.2: the second boundary backward before step() zips over None
        assert all(e and e.startswith("TypeError") for e in raised), raised
        return
    if known == SPLIT:  # 0.18.7-0.18.9, step() in grad mode: the flat buffer's views written in place, every rank
        assert all(e and e.startswith("RuntimeError") and "Output 0 of Split is a view" in e for e in raised), raised
        return
    assert raised == [None] * runs["world"], raised
    if known == LOST:  # the resumed window starts from the master weights of the engine's own model
        assert errors(runs, "unpatched", cell, CORRECT)[1] > 1
        return
    if known == CARRIED:  # the first window right, the second carrying it: the measured error
        first, second = errors(runs, "unpatched", cell, CORRECT)
        assert first < tolerance(cell), first
        assert second == pytest.approx(accumulation.MEASURED_CARRIED[f"z{cell.stage}-gas{cell.gas}-{cell.style}"],
                                       abs=5e-3)
    elif known == UNAVERAGED:  # each rank's own boundary micro-batch in its partition: the measured error
        measured = accumulation.MEASURED_UNAVERAGED[f"z{cell.stage}-gas{cell.gas}-{cell.style}"]
        assert errors(runs, "unpatched", cell, CORRECT)[0] == pytest.approx(measured, abs=5e-3)
    elif known == WRONG:  # no simple rule: far from the window and from its last micro-batch
        assert min(max(errors(runs, "unpatched", cell, s)) for s in (CORRECT, accumulation.LAST)) > 0.5
        return
    else:
        # An over-divided update is GAS or GAS**2 times smaller, its fp32 noise as many times larger relatively.
        bound = tolerance(cell) * cell.gas ** accumulation.EXTRA_DIVISIONS.get(known, 0)
        assert max(errors(runs, "unpatched", cell, known)) < bound, known
        if known != CORRECT:  # and it is really wrong, not just within tolerance of right
            assert max(errors(runs, "unpatched", cell, CORRECT)) > 0.1
    if accumulation.bf16_norm_misreported(cell, metadata.version("deepspeed")):  # the loss-scaled norm
        _, norms = expected(runs, cell, CORRECT)
        compared = len(norms) if known == CORRECT else 1  # a carried window's norm has no reference
        for rank_norms in runs["unpatched"][cell.name]["norms"]:
            scaled = [n * accumulation.LOSS_SCALE for n in norms[:compared]]
            assert rank_norms[:compared] == pytest.approx(scaled, rel=tolerance(cell))
    assert all(r["state"] == "inactive" for r in runs["unpatched"][cell.name]["runtime"])


def deepspeed_fixes_applied(runtime) -> set[str]:
    return {fix for fix, state in runtime["states"].items() if state == "applied"}


# The patched runs enable every DeepSpeed fix; those whose range holds the installed release apply.
IN_RANGE = {f.id for f in catalogue.FIXES
            if f.dist == "deepspeed" and versions.version_in_range(metadata.version("deepspeed"), f.affected)}


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
@uses(matrix)
def test_patched_matches_the_reference(runs, cell):
    result = runs["patched"][cell.name]
    assert result["errors"] == [None] * runs["world"], result["errors"]
    semantics = accumulation.known_patched(cell, metadata.version("deepspeed"))
    if semantics == LOST:  # the first window right, the resumed one still DeepSpeed's (not fixed)
        first, resumed = errors(runs, "patched", cell, CORRECT)
        assert first < tolerance(cell) and resumed > 1, (first, resumed)
        return
    assert max(errors(runs, "patched", cell, semantics)) < tolerance(cell), semantics
    _, norms = expected(runs, cell, semantics)
    assert not cell.clip or not norms or min(norms) > cell.clip  # clipping really acts in style (e)
    for rank_norms in result["norms"]:
        if cell.stage == 0 and cell.dtype == "fp32":  # no norm for a ZeRO-0 torch optimizer (DeepSpeed's bf16 ones have one)
            assert rank_norms == [None] * len(norms)
        else:
            assert rank_norms == pytest.approx(norms, rel=1e-5 if cell.dtype == "fp32" else tolerance(cell))
    for runtime in result["runtime"]:
        assert runtime["state"] == "applied"
        assert deepspeed_fixes_applied(runtime) == IN_RANGE, runtime["states"]
        seen = runtime["engine"]
        if cell.direct:  # loss.backward() never reaches engine.backward: the manual fix saw no engine
            assert seen is None, seen
            continue
        updates = sum(len(w) for w in accumulation.updates(cell, semantics))
        if cell.resume:  # the resumed engine saw only the second window
            updates //= 2
        # several backwards per step() at config GAS > 1: followed, so DeepSpeed's step() applied nothing
        pending = sum(op[0] == "backward" for op in accumulation.ops(cell)) if semantics == NOOP else 0
        active = accumulation.engine_may_take_over(cell, metadata.version("deepspeed"))
        assert (seen["active"], seen["windows"], seen["pending"]) == (active, updates, pending), seen
        # DeepSpeed's own style, a loop that flags its boundaries itself or goes through no_sync() /
        # coalesce_grad_reduction(), config GAS > 1, and ZeRO-0/3 accumulating at config GAS=1 are left to
        # DeepSpeed: nothing is reduced twice, nothing moves.
        takes_over = accumulation.zerofix_takes_over(cell, metadata.version("deepspeed"))
        assert seen["flushed"] == (updates if takes_over else 0), seen
        assert seen["mode"] == ("manual" if takes_over else "follow"), seen


def comparable(event: dict) -> dict:
    """An event with its collectives as calls and elements per collective: ZeRO-2's bucket boundaries vary
    between two *unpatched* engines of one process (measured: all_reduce 2144 + 1024 elements in one,
    2112 + 1056 in the next, same total), so the split of a reduction into buckets is not compared."""
    out = dict(event)
    for key in ("collectives", "read_collectives"):
        if key in out:
            calls, elements = {}, {}
            for item in out[key]:
                name, numel = item.rsplit(":", 1)
                calls[name] = calls.get(name, 0) + 1
                elements[name] = elements.get(name, 0) + int(numel)
            out[key] = (calls, elements)
    return out


@pytest.mark.parametrize("cell", TRANSPARENT, ids=lambda c: c.name)
@uses(matrix)
def test_a_path_deepspeed_gets_right_is_left_exactly_as_it_was(runs, cell):
    """Do no harm: unpatched and patched in the same ranks, every observable identical: the boundary flag
    before each backward, backward()'s value, the full gradient read after every backward DeepSpeed allows
    a read after (the boundary ones under ZeRO-1/2, every one under ZeRO-0/3), micro_steps, global_steps,
    lr and the grad norm after each step(), each op's collectives (entering and leaving no_sync() /
    coalesce_grad_reduction() and zero_grad() too), a checkpoint's tensors, and every parameter bitwise.
    Also where DeepSpeed is wrong and zerofix follows it on purpose (config GAS > 1: NOOP; ZeRO-1/2's own style
    with two backwards per micro-batch: TWICE): the observations cannot tell those from right usages."""
    version = metadata.version("deepspeed")
    if accumulation.known_unpatched(cell, version) != accumulation.known_patched(cell, version):
        pytest.skip("a fix changes this path on this release: the reference tests' business, not transparency's")
    unpatched, patched = runs["unpatched"][cell.name], runs["patched"][cell.name]
    assert unpatched["errors"] == patched["errors"] == [None] * runs["world"]
    for rank in range(runs["world"]):
        before, after = unpatched["events"][rank], patched["events"][rank]
        assert len(before) == len(after) == len(accumulation.ops(cell)) + 1  # + the checkpoint
        for i, (u, p) in enumerate(zip(before, after)):
            assert comparable(u) == comparable(p), (rank, i, u, p)
        if not (cell.stage in (1, 2) and accumulation.known_unpatched(cell, version) == NOOP):  # no read point
            assert sum(e.get("reads") is not None for e in before) >= accumulation.snapshots(cell)
    for u, p in zip(unpatched["snapshots"], patched["snapshots"], strict=True):
        assert all(torch.equal(u[name], p[name]) for name in u)
    for u, p in zip(unpatched["window_reads"], patched["window_reads"], strict=True):
        assert (u is None and p is None) or all(torch.equal(u[name], p[name]) for name in u)
    for runtime in patched["runtime"]:
        assert runtime["state"] == "applied"  # zerofix was there, and followed
        assert (runtime["engine"]["mode"], runtime["engine"]["flushed"]) == ("follow", 0), runtime["engine"]


@pytest.mark.parametrize("cell", TAKEOVER, ids=lambda c: c.name)
@uses(matrix)
def test_a_gradient_read_before_step_sees_the_window_mean(runs, cell):
    """Manual accumulation, a safe_get_full_grad read of every parameter after each backward: the read
    right before step() is the window's mean gradient, as DeepSpeed's own style reads it at its boundary.
    Unpatched, that read is the last micro-batch's (config GAS=1), refused (ZeRO-1/2 at config GAS>1), or
    the gradient of windows step() never applied (ZeRO-3 at config GAS>1)."""
    lr = reference.OPTIMIZERS["sgd"]([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"]
    snapshots, _ = expected(runs, cell, CORRECT)
    means, before = [], runs["init"]
    for after in snapshots:  # SGD without momentum: the update is -lr * the window's gradient
        means.append({name: (before[name].double() - after[name].double()) / lr for name in after})
        before = after

    def read_errors(variant):
        out = []
        for read, mean in zip(runs[variant][cell.name]["window_reads"], means, strict=True):
            if read is None:
                out.append(None)
                continue
            scale = max(float(m.abs().max()) for m in mean.values())
            out.append(max(float((read[n] - mean[n]).abs().max()) for n in mean) / scale)
        return out

    patched = read_errors("patched")
    assert max(patched) < 1e-6, patched
    if accumulation.known_unpatched(cell, metadata.version("deepspeed")) == ERROR:
        assert all(e and e.startswith("TypeError") for e in runs["unpatched"][cell.name]["errors"])
        return
    unpatched = read_errors("unpatched")
    assert all(e is None or e > 0.1 for e in unpatched[1:]), unpatched
    assert any(e is None or e > 0.1 for e in unpatched), unpatched
    (seen, *_) = [r["engine"] for r in runs["patched"][cell.name]["runtime"]]
    if cell.stage in (1, 2):  # a read after every backward: each lazy one reduced the window again
        assert seen["read_flushes"] > 0, seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@uses(matrix)
def test_checkpoint_resumed_at_a_window_boundary_continues_identically(runs, stage):
    resumed = runs["patched"][accumulation.Cell(stage, 1, "a", "adamw", resume=True).name]["snapshots"]
    straight = runs["patched"][accumulation.Cell(stage, 1, "a", "adamw").name]["snapshots"]
    assert max(parity.window_errors(runs["init"], resumed, straight)) < 1e-6


@pytest.mark.parametrize("stage", [1, 2])
@uses(matrix)
def test_short_last_window_of_an_epoch_is_applied(runs, stage):
    cell = accumulation.Cell(stage, 1, "short")
    assert len(runs["patched"][cell.name]["snapshots"]) == 3
    last_window_error = errors(runs, "patched", cell, CORRECT)[-1]
    assert last_window_error < TOLERANCE["sgd"]


@uses(matrix)
def test_several_backwards_per_step_at_config_gas_above_one_are_followed_and_warned_once(runs):
    """3 backwards per step() with config GAS=4: DeepSpeed applies nothing until 4 step() calls, exactly as
    its own style with several backwards per micro-batch; zerofix cannot tell them apart, follows, says so
    once per engine. DeepSpeed's own style with one backward per micro-batch gets no warning."""
    seen = runs["patched"][accumulation.Cell(2, 4, "d").name]["runtime"][0]["engine"]
    assert (seen["warnings"], seen["mode"], seen["flushed"]) == (["ambiguous"], "follow", 0)
    assert runs["patched"][accumulation.Cell(2, 4, "b", probe=True).name]["runtime"][0]["engine"]["warnings"] == []
    assert runs["patched"][accumulation.Cell(2, 1, "a").name]["runtime"][0]["engine"]["warnings"] == []


@pytest.mark.parametrize("cell", [c for c in AMBIGUOUS if c.style in ("g", "coalesce", "nosync", "zg")],
                         ids=lambda c: c.name)
@uses(matrix)
def test_a_usage_of_the_ambiguity_list_keeps_deepspeeds_updates_and_step_count(runs, cell):
    """Every cell of the ambiguity list, probed or not: the patched parameters after each window are the
    unpatched ones bitwise, and the engine ran as many optimizer steps (a takeover made every step() one)."""
    unpatched, patched = runs["unpatched"][cell.name], runs["patched"][cell.name]
    assert unpatched["errors"] == patched["errors"] == [None] * runs["world"]
    for u, p in zip(unpatched["snapshots"], patched["snapshots"], strict=True):
        assert all(torch.equal(u[name], p[name]) for name in u)
    assert unpatched["norms"] == patched["norms"]  # one norm per optimizer step, equal
    (seen, *_) = [r["engine"] for r in patched["runtime"]]
    assert (seen["mode"], seen["flushed"]) == ("follow", 0), seen


@pytest.mark.parametrize("stage", [1, 2])
@uses(matrix)
def test_zero_grad_between_backwards_discards_what_came_before_it(runs, stage):
    """A backward, zero_grad(), three backwards, step(): the update is the three's (DeepSpeed >= 0.18.3 keeps
    only the last; zerofix takes over from the second backward after zero_grad(), and a window lazily
    accumulated before a zero_grad() is reduced and discarded as DeepSpeed's boundaries would have)."""
    cell = accumulation.Cell(stage, 1, "z")
    if cell not in AMBIGUOUS:
        pytest.skip("deepspeed < 0.18.3: not measured")
    assert max(errors(runs, "unpatched", cell, accumulation.LAST)) < TOLERANCE["sgd"]
    assert max(errors(runs, "patched", cell, CORRECT)) < TOLERANCE["sgd"]
    (seen, *_) = [r["engine"] for r in runs["patched"][cell.name]["runtime"]]
    assert seen["zero_grads"] == 2 and seen["flushed"] == 2, seen


def trainer_request(stage):
    return [builders.trainer_gas_request(model="causal-lm", nproc=2, gas=8, extra_args=("--zero-stage", str(stage)))]


@pytest.mark.stack("latest", "2026-04")
@pytest.mark.parametrize("stage", [2, 3])
@uses(trainer_request)
def test_trainer_through_deepspeed_stays_exact(ranks, stage):
    """Accelerate's DeepSpeedEngineWrapper flags the boundary itself: zerofix must leave it alone."""
    (request,) = trainer_request(stage)
    result = ranks.result(request)
    for variant in ("unpatched", "patched"):
        assert result[variant]["rel_err"] < 1e-6, (variant, result[variant])
    # do no harm: DeepSpeed gets this path right, so the patched run's weights are the unpatched run's, bitwise
    unpatched, patched = (torch.load(ranks.folder(request) / variant / "final.pt") for variant in ("unpatched", "patched"))
    assert all(torch.equal(unpatched[name], patched[name]) for name in unpatched)
    for runtime in result["patched"]["rank_runtime"]:
        (seen,) = runtime[FIX]
        assert (seen["zero_stage"], seen["windows"], seen["flushed"]) == (stage, 1, 0), seen


SMOKE_OWN = next(c for c in TRANSPARENT if c.name == "z2-gas4-b-sgd-probe")
SMOKE_READ = [c for c in TAKEOVER if c.name == "z2-gas1-a-sgd-probe"]  # a takeover probe where one exists
# DeepSpeed's own coalesce_grad_reduction() (>= 0.19.7), where one exists: followed, every observable
SMOKE_COALESCE = [c for c in AMBIGUOUS if c.name == "z2-gas1-coalesce-sgd-probe"]
SMOKE_MANUAL = accumulation.Cell(2, 1, "a")


def smoke():
    return [builders.ds_request([SMOKE_MANUAL, SMOKE_OWN, *SMOKE_READ, *SMOKE_COALESCE], nproc=2)]


@pytest.mark.smoke(subset_of_matrix=True)
@uses(smoke)
def test_smoke_manual_window_fixed_reads_right_and_deepspeeds_own_style_untouched(ranks):
    """The fast tier's DeepSpeed smoke, one run of three cells of the matrices above: ZeRO-2 manual
    accumulation at config GAS=1 (both halves: unpatched as DeepSpeed is known to do on this release, patched
    equal to the reference), a manual window read with safe_get_full_grad before step() (the window's mean),
    and DeepSpeed's own style at GAS=4 (every observable identical unpatched and patched)."""
    version = metadata.version("deepspeed")
    own, read, coalesce, manual = SMOKE_OWN, SMOKE_READ, SMOKE_COALESCE, SMOKE_MANUAL
    runs = ranks.result(*smoke())
    test_unpatched_shows_what_deepspeed_is_known_to_do(runs, manual)
    test_patched_matches_the_reference(runs, manual)
    for cell in read:
        test_a_gradient_read_before_step_sees_the_window_mean(runs, cell)
    for cell in [own, *coalesce]:
        if accumulation.known_unpatched(cell, version) == CORRECT:
            test_a_path_deepspeed_gets_right_is_left_exactly_as_it_was(runs, cell)


REPATCHED = [accumulation.Cell(1, 1, "a"), accumulation.Cell(2, 1, "a"), accumulation.Cell(2, 4, "b"),
             accumulation.Cell(3, 4, "b", scale_wrt_gas=False)]


def repatched():
    return [builders.ds_request(REPATCHED, variants=("repatched",))]


@uses(repatched)
def test_every_deepspeed_fix_still_matches_the_reference_after_patch_unpatch_patch(ranks):
    """The orderings of test_orderings.py end in a training step: the DeepSpeed fixes in range are patched,
    unpatched and patched again (after DeepSpeed is imported), then a manual window (ZeRO-1/2, config GAS=1),
    DeepSpeed's own style at GAS=4 (ZeRO-2: the accumulator of 0.17.6-0.18.2) and the Trainer's
    scale_wrt_gas=False (ZeRO-3: the hook of 0.18.3) train as the patched runs do."""
    cells = REPATCHED
    runs = ranks.result(*repatched())
    for cell in cells:
        result = runs["repatched"][cell.name]
        assert result["errors"] == [None] * runs["world"], result["errors"]
        for runtime in result["runtime"]:
            assert runtime["state"] == "applied" and deepspeed_fixes_applied(runtime) == IN_RANGE, runtime["states"]
        semantics = accumulation.known_patched(cell, metadata.version("deepspeed"))
        assert max(errors(runs, "repatched", cell, semantics)) < TOLERANCE[cell.optimizer], (cell.name, semantics)


def test_environment_activation_reaches_every_rank_and_logs_once_per_engine(tmp_path):
    """ZEROFIX=1 ZEROFIX_LOG=info, a script that never calls patch(): both ranks fixed, one line each."""
    version = metadata.version("deepspeed")
    cells = [accumulation.Cell(2, 1, "a"), accumulation.Cell(1, 4, "d")]
    runs = builders.ds_accumulation(tmp_path, cells, variants=("env",),
                                  env={"ZEROFIX": "1", "ZEROFIX_LOG": "info"})
    for cell in cells:
        result = runs["env"][cell.name]
        assert [r["state"] for r in result["runtime"]] == ["applied", "applied"]
        assert max(errors(runs, "env", cell, accumulation.known_patched(cell, version))) < TOLERANCE["sgd"]
    log = (tmp_path / "launcher.log").read_text()
    for rank in (0, 1):
        for cell in cells:  # (2, 1, a) is taken over from 0.17.6; (1, 4, d) is followed
            state = "active" if accumulation.engine_may_take_over(cell, version) else "following DeepSpeed"
            prefix = f"[zerofix rank {rank}] INFO {FIX}: {state} on a DeepSpeed engine (ZeRO-{cell.stage}, "
            # anywhere in the line: the other rank's output (DeepSpeed prints lines in pieces) can leave a
            # line unfinished just before this one (measured once on 2025-12 in CI)
            lines = [line for line in log.splitlines() if prefix in line]
            assert len(lines) == 1, log[-3000:]
    assert f"[zerofix rank 0] WARNING {FIX}: 3 backward() calls before a step() that DeepSpeed does not" in log


@pytest.mark.stack("latest", "2025-10")  # the two bucket layouts of _prepare_buckets (CI time)
def test_the_flush_communicates_exactly_what_a_boundary_backward_does(tmp_path):
    """benchmarks/bench_deepspeed_accumulation.py counts every torch.distributed collective (calls and
    elements) of one window; zerofix's lazy boundary must match DeepSpeed's own boundary on every stage.
    The timings it also measures are the benchmark's business, not this test's: it runs the counting part only."""
    import json
    import subprocess
    import sys

    from zerofix.check.launch import scenario_env

    out = tmp_path / "bench.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deepspeed_accumulation.py"
    # its ranks forked after one import (zerofix.check.forkrun: torchrun's stand-in, 9 CPU s of imports a rank saved)
    proc = subprocess.run([sys.executable, "-m", "zerofix.check.forkrun", "2", "--import", "deepspeed", str(bench),
                           str(out)],
                          env=scenario_env({"BENCH_PARTS": "collectives"}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage, rows in json.loads(out.read_text())["collectives"].items():
        boundary, lazy, _unpatched = rows.values()
        assert lazy == boundary, (stage, rows)
        assert sum(boundary["calls"].values()) > 0
    assert set(json.loads(out.read_text())["collectives"]) == {"ZeRO-1", "ZeRO-2"}


MID_WINDOW_CHECKPOINT = """
import sys, torch, deepspeed, zerofix
from zerofix.check import accumulation, models, reference
from zerofix.check.rank import finish
from zerofix.check.scenarios.ds_accumulation import ds_config
deepspeed.init_distributed(dist_backend="gloo")
zerofix.patch(fixes={fixes!r})
rank = torch.distributed.get_rank()
for stage in (1, 2):
    model = models.build_model("custom", seed=0, loss_only=True)
    cell = accumulation.Cell(stage, 1, "a")  # config GAS=1: taken over from 0.17.6
    engine, *_ = deepspeed.initialize(model=model, optimizer=reference.OPTIMIZERS["sgd"](model.parameters()),
                                      config=ds_config(cell))
    for window, backwards in enumerate((4, 2)):  # a whole window, then save after 2 of the next 4
        for m in range(backwards):
            engine.backward(engine(**models.collate(accumulation.sample_indices(m, rank, 2)))["loss"] / 4)
        if window == 0:
            with torch.no_grad():
                engine.step()
            engine.save_checkpoint(sys.argv[1], tag=f"z{{stage}}-boundary")  # right after step(): silent
    engine.save_checkpoint(sys.argv[1], tag=f"z{{stage}}-mid-window")
    print("SAVED", stage, rank, flush=True)
finish()
"""


@pytest.mark.stack("latest", "2026-04", "2025-12", "2025-10")  # deepspeed >= 0.17.6: ZeRO-1/2 taken over at GAS=1
def test_a_checkpoint_in_the_middle_of_a_manual_window_is_warned_on_every_rank(tmp_path):
    """The pending micro-batches are not in a checkpoint (a run resumed from one taken after 2 of 4
    backwards never applies them): zerofix says so on every rank, once per such checkpoint, ZeRO-1 and
    ZeRO-2; a checkpoint right after step() stays silent."""
    import subprocess
    import sys

    from zerofix.check.launch import scenario_env

    script = tmp_path / "mid_window.py"
    fixes = [f.id for f in catalogue.FIXES if f.dist == "deepspeed"]  # 0.18.0: with the accumulator's fix
    script.write_text(MID_WINDOW_CHECKPOINT.format(fixes=fixes))
    proc = subprocess.run([sys.executable, "-m", "zerofix.check.forkrun", "2", "--import", "deepspeed", str(script),
                           str(tmp_path / "ckpt")],
                          env=scenario_env(), capture_output=True, text=True, timeout=300)  # forked ranks, as above
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("SAVED") == 4
    warning = (f"{FIX}: save_checkpoint() in the middle of an accumulation window: the 2 micro-batch(es) "
               "accumulated since the last step() are not in the checkpoint")
    assert out.count(warning) == 4, out[-3000:]  # 2 stages x 2 ranks, none for the boundary checkpoints
    assert out.count(f"{FIX}: save_checkpoint()") == 4
