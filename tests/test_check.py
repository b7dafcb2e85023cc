"""``zerofix check``: the verdict logic and the output without ranks, then real runs of the command.

The real runs assert, per stack, the verdict of every scenario of the default run (so a stack that stops
showing a bug, or a fix that stops fixing it, is noticed), the ``--quick`` set, an injected scaling bug no
catalogue entry explains (``WRONG``, exit code 1) and the ``--plot`` curves' numbers.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerofix import cli
from zerofix.check import launch, plan, report, verdict

RIGHT = {"ratio": 1.0, "cosine": 1.0, "rel_err": 2e-7}
LAST = {"ratio": 0.166, "cosine": 0.384, "rel_err": 1.08}


# ---- verdicts, selection, output: no ranks --------------------------------------------------------------

@pytest.mark.parametrize("unpatched, patched, applied, expected", [
    (RIGHT, RIGHT, [], ("ok", "ok")),
    (RIGHT, RIGHT, ["some-fix"], ("ok", "ok")),  # a fix applied where nothing was wrong changes nothing
    (None, RIGHT, [], ("ok", "ok")),  # an API: only the zerofix run
    (LAST, RIGHT, ["a", "b"], ("fixed", "fixed by a + b")),
    ({"error": "TypeError: x"}, RIGHT, ["a"], ("fixed", "fixed by a")),  # a crash fixed
    (LAST, LAST, ["a"], ("WRONG", "WRONG")),  # wrong patched: whatever was applied
    (RIGHT, LAST, [], ("WRONG", "WRONG")),  # zerofix broke it
    (LAST, RIGHT, [], ("WRONG", "WRONG")),  # the runs differ and nothing was applied: not reproducible
    (RIGHT, {"error": "RuntimeError"}, [], ("WRONG", "WRONG")),
    (RIGHT, None, [], ("failed", "failed")),
])
def test_verdict(unpatched, patched, applied, expected):
    assert verdict.verdict(unpatched, patched, applied) == expected


def test_tolerance_is_the_boundary():
    assert verdict.is_right({"rel_err": verdict.TOLERANCE})
    assert not verdict.is_right({"rel_err": verdict.TOLERANCE * 1.01})
    assert verdict.verdict(RIGHT, {"ratio": 1, "cosine": 1, "rel_err": 5e-6}, [], tolerance=1e-6)[0] == "WRONG"


def test_exit_code():
    assert verdict.exit_code(["ok", "fixed", "skipped"]) == 0
    assert verdict.exit_code(["ok", "WRONG"]) == 1
    assert verdict.exit_code(["ok", "failed"]) == 1


def test_known_notes_need_every_version(monkeypatch):
    known = verdict.Known(("accelerate-zero2-*", "accelerate-zero3-*"),
                          (("accelerate", "==1.3.0"), ("deepspeed", "==0.16.3")), "a note")
    monkeypatch.setattr(verdict, "KNOWN", (known,))
    assert verdict.known_note("accelerate-zero3-x", {"accelerate": "1.3.0", "deepspeed": "0.16.3"}) == "a note"
    assert verdict.known_note("accelerate-zero2-x", {"accelerate": "1.3.0", "deepspeed": "0.16.4"}) is None
    assert verdict.known_note("trainer-zero2-x", {"accelerate": "1.3.0", "deepspeed": "0.16.3"}) is None


def test_selection():
    names = [s.name for s in plan.select()]
    assert names == list(plan.NAMES) and len(set(names)) == len(names)
    assert [s.name for s in plan.select(quick=True)] == [s.name for s in plan.SCENARIOS if s.quick]
    assert [s.name for s in plan.select(only=["deepspeed-*"], skip=["*-own"])] == [
        "deepspeed-zero1-manual", "deepspeed-zero2-manual", "deepspeed-zero3-manual",
        "deepspeed-zero1-offload-manual", "deepspeed-zero2-offload-manual"]
    with pytest.raises(plan.UsageError, match="no scenario matches 'deepspeed-zero4'.*trainer-1proc-causal-lm"):
        plan.select(only=["deepspeed-zero4"])
    assert all(s.job in plan.JOBS for s in plan.SCENARIOS)


def test_every_job_has_a_planner():
    from zerofix.check import jobs

    assert all(callable(jobs.planner(job)) for job in plan.JOBS.values())


def test_every_fix_a_scenario_names_is_in_the_catalogue():
    from zerofix import catalogue

    ids = {f.id for f in catalogue.FIXES}
    assert {f for s in plan.SCENARIOS for f in s.fixes} <= ids


def test_skip_reasons():
    job = plan.JOBS["trl-sft"]
    found = {"trl": "0.14.0", "transformers": "4.48.3", "accelerate": "1.3.0", "deepspeed": "0.16.3", "datasets": "3"}
    assert plan.skip_reason(job, 2, found) == "trl 0.14.0 has no loss_type='chunked_nll' (new in 1.4.0)"
    assert plan.skip_reason(job, 2, dict(found, trl="1.5.1")) is None
    assert plan.skip_reason(plan.JOBS["trainer-ddp"], 1, found) == "needs 2 ranks (--nproc 1)"
    assert plan.skip_reason(plan.JOBS["trainer-1proc"], 1, found) is None


def test_table_and_summary():
    rows = [
        {"name": "a-row", "status": "ok", "verdict": "ok", "unpatched": RIGHT, "patched": RIGHT},
        {"name": "b-row", "status": "fixed", "verdict": "fixed by f", "unpatched": {"error": "TypeError:\n boom"},
         "patched": RIGHT},
        {"name": "c-row", "status": "WRONG", "verdict": "WRONG", "unpatched": None,
         "patched": {"ratio": 0.25, "cosine": None, "rel_err": 0.75}, "note": "known, not fixed: x"},
        {"name": "d-row", "status": "failed", "verdict": "failed", "unpatched": None, "patched": None,
         "tail": "rank 1:\nAssertionError: y"},
        {"name": "e-row", "status": "failed", "verdict": "failed", "unpatched": None, "patched": None,
         "tail": "rank 1:\nAssertionError: y"},
        {"name": "f-row", "status": "skipped", "verdict": "skipped: trl not installed"},
    ]
    text = report.table(rows)
    assert re.search(r"^b-row +crash +1\.0000 +1\.0000 +fixed by f$", text, re.M), text
    assert re.search(r"^c-row +- +- +0\.2500 +- +WRONG$", text, re.M), text
    assert re.search(r"^f-row +skipped: trl not installed$", text, re.M), text
    header = next(line for line in text.splitlines() if line.startswith("scenario"))
    assert all(line.index("verdict") == header.index("verdict") for line in text.splitlines() if "verdict" in line)
    a_row = next(line for line in text.splitlines() if line.startswith("a-row"))
    assert a_row.index("1.0000") == header.index("ratio")  # the unpatched ratio under its heading
    assert "* b-row: unpatched: TypeError: boom" in text
    assert "* c-row: known, not fixed: x" in text
    # one failed job: its failing rank's lines once, for both rows
    assert text.count("AssertionError: y") == 1 and "* d-row, e-row: the job failed" in text
    assert report.summary(rows, 61.4) == "\n1 ok, 1 fixed, 1 WRONG, 2 failed, 1 skipped; total 61 s"


def test_failing_rank_tail():
    output = ("[rank0]: noise of rank 0\n" + "[rank1]: noise\n" * 30 + "[rank1]: Traceback (most recent call last):\n"
              "[rank1]:     ^^^^^\n[rank1]: ValueError: boom\n[rank0]: more of rank 0\n"
              "E1122 ... failed (exitcode: 1) local_rank: 1\n"
              "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-22\n  rank      : 1 (local_rank: 1)\n"
              "  exitcode  : 1 (pid: 8423)\n")
    expected = "rank 1:\nnoise\nTraceback (most recent call last):\nValueError: boom"  # no caret line
    assert launch.failing_rank_tail(output, lines=3) == expected
    # no root cause, or no prefixed lines of that rank: the launcher's last lines
    assert launch.failing_rank_tail("a\nb\nc", lines=2) == "b\nc"
    no_traceback = "x\nRoot Cause\n  rank : 3 (local_rank: 3)"
    assert launch.failing_rank_tail(no_traceback, lines=1) == "  rank : 3 (local_rank: 3)"


def run_cli(*argv) -> int:
    try:
        return cli.main(["check", *argv])
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, message", [
    (["--only", "nope"], "no scenario matches 'nope'"),
    (["--quick", "--nproc", "2"], "--quick runs 1 process"),
    (["--nproc", "0"], "argument --nproc: 0 is not a positive number (1 or more)"),
    (["--nproc", "two"], "argument --nproc: 'two' is not a whole number"),
    (["--only", "trainer-1proc-custom", "--skip", "trainer-*"], "no scenario left to run"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: the directory /nonexistent-dir does not"),
    (["--fsdp-config", "/nonexistent.json"], "--fsdp-config /nonexistent.json: No such file or directory"),
    (["--fsdp-config", "{tmp}/typo.json"], "unknown key 'reshard_after_froward' (did you mean 'reshard_after_forward'?)"),
    (["--fsdp-config", "{tmp}/list.json"], "a JSON object of fsdp_config keys is needed, not list"),
    (["--fsdp-config", "{tmp}/v1.json"], "version 1: FSDP1 does not run on CPU"),
    (["--fsdp-config", "{tmp}/v1.json", "--quick"], "--fsdp-config runs the Trainer's FSDP rows"),
])
def test_usage_errors_exit_2_and_say_why(argv, message, capsys, tmp_path):
    for name, text in (("typo.json", '{"reshard_after_froward": false}'), ("list.json", "[]"),
                       ("v1.json", '{"fsdp_version": 1}')):
        (tmp_path / name).write_text(text)
    assert run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    # one line: the problem and where the options are, no usage block before it
    assert message in err and err.count("\n") == 1 and "--help' lists the options" in err, err


def test_plot_without_matplotlib_is_a_usage_error_that_names_the_fix(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert run_cli("--quick", "--plot", "x.png") == 2
    assert "--plot needs matplotlib, which is not installed here: pip install matplotlib" in capsys.readouterr().err


def test_list_prints_every_scenario(capsys):
    assert run_cli("--list") == 0
    out = capsys.readouterr().out
    assert all(name in out for name in plan.NAMES)


def test_list_prints_the_rows_that_would_run(tmp_path, capsys):
    """--list follows --only and --deepspeed: the rows a run with the same arguments trains."""
    assert run_cli("--list", "--only", "trainer-1proc-*") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [
        n for n in plan.NAMES if n.startswith("trainer-1proc-")]
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}')
    assert run_cli("--list", "--deepspeed", str(ds)) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [
        "trainer-causal-lm", "trainer-custom", "accelerate-causal-lm", "deepspeed-manual", "deepspeed-own"]


def test_progress_is_whole_lines_when_not_a_terminal():
    """A saved log gets one line per job, no carriage returns (tqdm's bar only on a terminal)."""
    import io

    stream = io.StringIO()
    bar = report.progress(3, stream)
    for name in ("trainer-1proc", "deepspeed"):  # two sessions side by side: both start before either ends
        bar.set_description(name)
    bar.update(1)
    bar.set_description("zero3-loss")
    bar.update(2)
    bar.close()
    assert stream.getvalue() == ("zerofix check: run 1/3: trainer-1proc\nzerofix check: run 2/3: deepspeed\n"
                                 "zerofix check: run 3/3: zero3-loss\n")


@pytest.mark.stack_independent
def test_make_check_exits_with_the_checks_status(tmp_path):
    """`make check` in a user's CI fails when the check does (a WRONG row exits 1): the recipe, run with a stand-in
    for the stack's zerofix that exits 1."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    for name in ("Makefile", "setup.cfg", "setup.py"):
        shutil.copy(root / name, tmp_path / name)
    (tmp_path / "constraints").mkdir()
    (tmp_path / "constraints" / "fake.txt").write_text("")
    bin_dir = tmp_path / ".venvs" / "fake" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "zerofix").write_text("#!/bin/sh\necho 'a WRONG row'\nexit 1\n")
    (bin_dir / "zerofix").chmod(0o755)
    # the order-only prerequisites present (the tools environment, torch's wheel) and the stack's marker newer than
    # the files it depends on: nothing is built (no download)
    for made in (".venvs/.tools/bin/uv", ".venvs/.wheels/.fetched", ".venvs/fake/.installed"):
        (tmp_path / made).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / made).touch()
    proc = subprocess.run(["make", "-s", "check", "CHECK_STACK=fake"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "zerofix check exited with 1" in proc.stdout, (proc.returncode, proc.stdout)
    (bin_dir / "zerofix").write_text("#!/bin/sh\nexit 0\n")
    assert subprocess.run(["make", "-s", "check", "CHECK_STACK=fake"], cwd=tmp_path).returncode == 0


# ---- real runs ------------------------------------------------------------------------------------------

def zerofix_check(tmp_path, *argv, env=None, timeout=900):
    """``zerofix check`` in a subprocess (as a user runs it): (exit code, JSON document, stdout)."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "zerofix", "check", "--json", str(out), *argv],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def verdicts(document) -> dict:
    return {r["name"]: r["verdict"] for r in document["scenarios"]}


MANUAL = "fixed by deepspeed-manual-accumulation"
HOOK = "fixed by deepspeed-output-hook-division"
GRPO_ROWS = [n for n in plan.NAMES if n.startswith("trl-grpo-")]
# the GRPO rows run on every stack that installs requests (the grpo extra: latest, 2026-04 and the trl stacks)
NO_DISTILL_LOOP = "skipped: trl {} has no chunked divergence loop (DistillationTrainer, 1.10.0 - 1.14.x)"
SP_NO_MESH = ("skipped: transformers' SP loss reads accelerator.torch_device_mesh['sp'], which this accelerate does not "
              "build for DeepSpeed SP: every SP step stops at its first loss, unpatched and patched")
EXPECTED = {
    # The default run, every scenario: what the catalogue says each stack does.
    "latest": {**{n: "ok" for n in plan.NAMES},
               # a classifier: GAS x processes on every path
               **{f"trainer-{w}-seq-cls": "fixed by transformers-trainer-scaling"
                  for w in ("1proc", "ddp", "fsdp2", "zero2", "zero3")},
               # the router auxiliary loss: GAS x (the cross-entropy is right)
               "trainer-1proc-moe": "fixed by transformers-moe-aux-loss",
               **{f"deepspeed-zero{s}-{o}manual": MANUAL for s in (1, 2) for o in ("", "offload-")},
               "trl-sft-uneven-chunks": "skipped: trl 1.16.0 has no _chunked_cross_entropy_loss (1.4.0 - 1.14.x; "
               "from 1.15.0 chunked_nll is nll)", "trl-distill-uneven-chunks": NO_DISTILL_LOOP.format("1.16.0"),
               # DeepSpeed Ulysses: 2x the mean of micro-batch means (ZeRO-2), the mean of means (ZeRO-3)
               **{f"trainer-sp-zero{s}": "fixed by transformers-deepspeed-sp-loss" for s in (2, 3)},
               },
    "2026-04": {
        **{n: "ok" for n in plan.NAMES},
        "trl-sft-uneven-chunks": "fixed by trl-chunked-nll-zero3",
        # trl 1.5.1: GRPO's dapo loss over steps_per_generation != GAS, and 5.3's second division of its loss
        **{n: "fixed by trl-grpo-window-normalisation + transformers-trainer-scaling" for n in GRPO_ROWS},
        "trl-distill-uneven-chunks": NO_DISTILL_LOOP.format("1.5.1"),
        **{f"trainer-{w}-{m}": "fixed by transformers-trainer-scaling"
           for w in ("1proc", "ddp") for m in ("causal-lm", "custom")},
        # a classifier: right on one process (accelerate's second division is the one a mean needs), 2x on two
        # ranks, 8x through DeepSpeed (GAS x processes)
        **{f"trainer-{w}-seq-cls": "fixed by transformers-trainer-scaling" for w in ("ddp", "fsdp2", "zero2", "zero3")},
        # FSDP2 divides as DDP does: accelerate's second division on 5.3
        "trainer-fsdp2-causal-lm": "fixed by transformers-trainer-scaling",
        # the cross-entropy divided again by accelerate (the Trainer entry), the auxiliary term kept right
        "trainer-1proc-moe": "fixed by transformers-trainer-scaling + transformers-moe-aux-loss",
        "accelerate-zero2-causal-lm": HOOK, "accelerate-zero2-custom": HOOK,
        **{f"deepspeed-zero{s}-{o}manual": MANUAL for s in (1, 2) for o in ("", "offload-")},
        "deepspeed-zero2-offload-own": "fixed by deepspeed-offload-accumulator",
        "deepspeed-zero1-bf16-own": "fixed by deepspeed-bf16-boundary-reduction",
        # transformers 5.3 with accelerate 1.13: every SP step stops at its first loss (no device mesh)
        **{f"trainer-sp-zero{s}": SP_NO_MESH for s in (2, 3)},
    },
}


# The rows that show each stack's bugs, and one row of every other kind of job that shares their code path (the
# whole run on both stacks: docs/check.md, same verdicts). Run elsewhere on these stacks, for CI time: trainer-1proc
# (--quick's smoke), trainer-zero2 and accelerate-zero2 on 2026-04 / trainer-zero2 on latest (with a user's
# configuration, tests/test_check_own_config.py), trainer-zero3 (test_trainer_scaling), accelerate-ddp
# (test_accelerate_loop), zero3-loss (test_zero3_loss), trl-sft (test_trl_chunked_nll).
RUNS = {"latest": "trainer-ddp-*,accelerate-zero2-*,deepspeed-*,trainer-sp-*",
        "2026-04": "trainer-ddp-*,deepspeed-*-manual,deepspeed-zero2-offload-own,deepspeed-zero1-bf16-own"}


@pytest.mark.distributed
@pytest.mark.stack(*RUNS)
def test_default_run_verdicts(tmp_path, stack):
    code, document, stdout = zerofix_check(tmp_path, *(["--only", RUNS[stack]] if RUNS[stack] else []))
    selected = {s.name for s in plan.select(only=RUNS[stack].split(",") if RUNS[stack] else None)}
    expected = {name: v for name, v in EXPECTED[stack].items() if name in selected}
    assert verdicts(document) == expected, stdout
    assert code == (1 if "WRONG" in expected.values() else 0)
    rows = {r["name"]: r for r in document["scenarios"]}
    for name, row in rows.items():
        assert row["patched"]["rel_err"] < row["tolerance"] if row["status"] != "WRONG" else True
        if row["status"] == "fixed":  # the unpatched half: the measured bug, not noise
            assert "error" in row["unpatched"] or row["unpatched"]["rel_err"] > 0.3, (name, row)
    for name in ("deepspeed-zero1-manual", "deepspeed-zero2-manual"):  # only the last micro-batch survives
        assert rows[name]["unpatched"]["cosine"] < 0.5, rows[name]
    if stack == "2026-04":
        for name in ("trainer-ddp-causal-lm", "trainer-ddp-custom"):
            assert rows[name]["unpatched"]["ratio"] == pytest.approx(1 / 8, rel=1e-4)
    assert document["versions"]["deepspeed"] and document["nproc"] == 2
    assert "total" in stdout and document["seconds"] > 0


ZERO12 = "fixed by deepspeed-zero12-accumulator"
SUBSETS = {
    # The older stacks (the full run is ~1.5 min each): the scenarios that show each stack's bugs.
    "2025-12": ("trainer-zero2-*,trainer-zero3-*,accelerate-zero2-custom,trainer-sp-*", {
        # DeepSpeed Ulysses on 5.0 / 0.18.3: 0.5x the mean of means (GA divided twice); the SP entry passes
        # scale_wrt_gas=False, which 0.18.3 honours only with its 0.19 handling backported
        **{f"trainer-sp-zero{s}": "fixed by transformers-deepspeed-sp-loss + deepspeed-scale-wrt-gas" for s in (2, 3)},
        **{f"trainer-zero{s}-{m}": "fixed by deepspeed-scale-wrt-gas" for s in (2, 3) for m in ("causal-lm", "custom")},
        # the classifier: GAS x processes from the Trainer, then DeepSpeed 0.18.3's division (1/GAS^2, 1/GAS)
        **{f"trainer-zero{s}-seq-cls": "fixed by transformers-trainer-scaling + deepspeed-scale-wrt-gas" for s in (2, 3)},
        "accelerate-zero2-custom": HOOK}),
    "2025-10": ("trainer-zero2-custom,accelerate-zero2-custom,deepspeed-zero2-*", {
        "trainer-zero2-custom": ZERO12, "accelerate-zero2-custom": ZERO12, "deepspeed-zero2-own": ZERO12,
        "deepspeed-zero2-manual": "fixed by deepspeed-manual-accumulation + deepspeed-zero12-accumulator",
        "deepspeed-zero2-offload-manual": MANUAL, "deepspeed-zero2-offload-own": "fixed by deepspeed-offload-accumulator"}),
    "2025-01": ("trainer-zero3-*,accelerate-zero2-custom", {
        "trainer-zero3-causal-lm": "fixed by transformers-trainer-scaling",
        "trainer-zero3-custom": "fixed by transformers-trainer-scaling",
        "trainer-zero3-seq-cls": "fixed by transformers-trainer-scaling",  # no **kwargs on 4.48: divided twice
        "accelerate-zero2-custom": "fixed by accelerate-deepspeed-no-sync"}),  # unpatched: a crash
    "2024-11": ("trainer-1proc-*,trainer-zero3-*", {
        "trainer-1proc-causal-lm": "ok", "trainer-1proc-custom": "fixed by transformers-trainer-scaling",
        "trainer-1proc-seq-cls": "fixed by transformers-trainer-scaling",
        "trainer-1proc-moe": "fixed by transformers-moe-aux-loss",  # 4.46: the router term GAS x
        "trainer-zero3-causal-lm": "fixed by transformers-trainer-scaling", "trainer-zero3-custom": "ok",
        "trainer-zero3-seq-cls": "ok"}),
}


@pytest.mark.distributed
@pytest.mark.stack(*SUBSETS)
def test_older_stacks_verdicts(tmp_path, stack):
    only, expected = SUBSETS[stack]
    code, document, stdout = zerofix_check(tmp_path, "--only", only)
    assert verdicts(document) == expected, stdout
    assert code == (0 if set(expected.values()) <= {"ok"} | {v for v in expected.values() if v.startswith("fixed")}
                    else 1)
    rows = {r["name"]: r for r in document["scenarios"]}
    for name, row in rows.items():
        if row["status"] == "fixed":
            assert "error" in row["unpatched"] or row["unpatched"]["rel_err"] > 0.3, (name, row)
    if stack == "2025-01":  # the unpatched crash, as the failing rank printed it
        row = rows["accelerate-zero2-custom"]
        assert "no_sync context manager is incompatible" in row["unpatched"]["error"], row
        assert row["unpatched"]["error"].startswith("rank "), row
    if stack == "2024-11":
        assert rows["trainer-1proc-custom"]["unpatched"]["ratio"] == pytest.approx(8, rel=1e-4)


@pytest.mark.distributed  # the full tier's (16 s: the fast tier's time, issue 68)
@pytest.mark.stack("latest")
def test_quick_runs_one_process_and_its_small_set(tmp_path):
    code, document, stdout = zerofix_check(tmp_path, "--quick")
    assert code == 0, stdout
    assert document["nproc"] == 1
    assert verdicts(document) == {"trainer-1proc-causal-lm": "ok", "trainer-1proc-custom": "ok",
                                  "trainer-1proc-seq-cls": "fixed by transformers-trainer-scaling",
                                  "deepspeed-zero2-manual": MANUAL, "deepspeed-zero2-own": "ok"}


HALVE_LOSS = '''
import os
# Only in the ranks of the scenario's job (their launcher sets LOCAL_RANK), never in zerofix check itself, which
# computes the reference: every backward of the run sees half the loss. No catalogue entry explains it. Asked at
# each backward, not at start-up: zerofix check forks its ranks from a process that started without LOCAL_RANK.
if os.environ.get("HALVE_THE_LOSS") == "1":
    import torch

    _backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        return _backward(self * 0.5 if "LOCAL_RANK" in os.environ else self, *args, **kwargs)

    torch.Tensor.backward = backward
'''


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_an_uncatalogued_scaling_bug_reads_wrong_and_exits_1(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent(HALVE_LOSS))
    pythonpath = os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])
    code, document, stdout = zerofix_check(tmp_path, "--only", "trainer-1proc-custom",
                                           env={"PYTHONPATH": pythonpath, "HALVE_THE_LOSS": "1"})
    row = document["scenarios"][0]
    assert code == 1 and row["verdict"] == "WRONG", stdout
    for variant in ("unpatched", "patched"):
        assert row[variant]["ratio"] == pytest.approx(0.5, rel=1e-4) and row[variant]["cosine"] > 0.9999
    assert "WRONG" in stdout and "1 WRONG" in stdout


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_plot_shows_the_divergence(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    code, document, stdout = zerofix_check(tmp_path, "--only", "deepspeed-zero2-manual,deepspeed-zero3-manual",
                                           "--plot", str(png))
    assert code == 0, stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (curve,) = document["curves"]  # the scenario with a bug only (ZeRO-3 is right)
    assert curve["name"] == "deepspeed-zero2-manual" and len(curve["reference"]) == 21
    ref, patched, unpatched = curve["reference"], curve["patched"], curve["unpatched"]
    assert ref[-1] < ref[0] - 0.3  # the reference learns the repeated window
    assert max(abs(p - r) for p, r in zip(patched, ref, strict=True)) < 1e-4
    assert unpatched[-1] > ref[-1] + 0.3  # only the last micro-batch of each window trains
    assert "written to" in stdout


@pytest.mark.distributed
@pytest.mark.stack("trl151-ds0154")
def test_trl_chunked_nll_crashes_unpatched_and_is_fixed(tmp_path):
    code, document, stdout = zerofix_check(tmp_path, "--only", "trl-sft-chunked-nll")
    (row,) = document["scenarios"]
    assert code == 0 and row["verdict"] == "fixed by trl-chunked-nll-zero3", stdout
    assert "size mismatch" in row["unpatched"]["error"] and "vec (0)" in row["unpatched"]["error"]
    assert row["patched"]["rel_err"] < 1e-5


@pytest.mark.parametrize("stack", sorted(EXPECTED))
def test_docs_show_the_real_verdicts(stack):
    """docs/check.md's outputs (pasted from real runs) list every scenario with the verdict the stack's
    test asserts, and the versions of that stack."""
    from pathlib import Path

    from conftest import stack_pins

    page = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    block = page.split(f"<!-- check-output: {stack} -->\n```\n", 1)[1].split("```", 1)[0]
    rows = {}
    for line in block.splitlines():
        fields = line.split()
        if fields and fields[0] in plan.NAMES:
            rest = fields[1:]  # the ratio/cosine columns (a number, "-" or "crash"), then the verdict
            while rest and rest[0] != "skipped:" and (rest[0] in ("-", "crash") or rest[0].replace(".", "").isdigit()):
                rest = rest[1:]
            rows[fields[0]] = " ".join(rest)
    assert rows == EXPECTED[stack]
    pins = stack_pins(stack)
    assert all(f"{d} {pins[d]}" in block for d in ("transformers", "accelerate", "deepspeed", "trl"))


@pytest.mark.distributed
@pytest.mark.stack("trl160")
def test_trl_rows_on_trl160(tmp_path):
    """trl 1.6.0: the uneven-chunks row hangs unpatched (bounded, then killed) and is fixed by the per-chunk
    gather entry; both GRPO rows show GAS/steps_per_generation unpatched and are fixed."""
    code, document, stdout = zerofix_check(tmp_path, "--only", "trl-sft-uneven-chunks,trl-grpo-*")
    rows = {r["name"]: r for r in document["scenarios"]}
    assert code == 0, stdout
    assert rows["trl-sft-uneven-chunks"]["verdict"] == "fixed by trl-chunked-nll-gather-zero3", stdout
    assert rows["trl-sft-uneven-chunks"]["unpatched"]["error"].startswith("hung: "), stdout
    for name, factor in (("trl-grpo-dapo-spg4-gas2", 0.5), ("trl-grpo-dapo-spg2-gas4", 2.0)):
        assert rows[name]["verdict"] == "fixed by trl-grpo-window-normalisation", stdout
        assert abs(rows[name]["unpatched"]["ratio"] - factor) < 1e-5 * factor, stdout
        assert rows[name]["patched"]["rel_err"] < 1e-5, stdout


@pytest.mark.distributed
@pytest.mark.stack("trl1100")
def test_trl_distill_row_on_trl1100(tmp_path):
    """trl 1.10.0: DistillationTrainer's uneven chunk counts abort unpatched (gloo) and are fixed."""
    code, document, stdout = zerofix_check(tmp_path, "--only", "trl-distill-uneven-chunks")
    row = {r["name"]: r for r in document["scenarios"]}["trl-distill-uneven-chunks"]
    assert code == 0, stdout
    assert row["verdict"] == "fixed by trl-distillation-chunked-gather-zero3", stdout
    assert row["unpatched"]["error"].startswith(("crash: ", "hung: ")), stdout
    assert row["patched"]["rel_err"] < 1e-5, stdout


def test_a_lock_left_by_an_interrupted_build_is_cleared_or_named(tmp_path):
    """torch's JIT build lock in the extensions directory: an old one nobody works next to is removed; a young
    one (a build may be running) is named with the command that removes it; the pre-flight says which."""
    import os as _os

    from zerofix.check.host import jitlock

    old, young = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (old, young):
        lock.parent.mkdir()
        lock.touch()
    now = old.stat().st_mtime + jitlock.STALE_AFTER + 60
    _os.utime(young, (now - 5, now - 5))
    messages = jitlock.clear_stale(tmp_path, now=now, busy=set())
    assert not old.exists() and young.exists()
    assert any(m.startswith(f"removed {old}") for m in messages)
    assert any(f"rm {young}" in m for m in messages)
    # a directory a live process works in (a compiler building there) keeps its lock, whatever its age
    old.touch()
    _os.utime(old, (now - jitlock.STALE_AFTER - 1,) * 2)
    jitlock.clear_stale(tmp_path, now=now, busy={_os.path.realpath(old.parent)})
    assert old.exists()
    assert jitlock.clear_stale(tmp_path / "absent") == []
