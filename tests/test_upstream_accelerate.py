"""accelerate's own test suite as a peer: the same outcome for every test with and without zerofix.

accelerate's sdist ships its tests. This downloads the pinned release's sdist with pip (nothing of it is
kept in this repository) and runs the CPU-runnable files about accumulation, backward, optimizers,
schedulers and checkpointing twice, in fresh interpreters: without zerofix, and with ``ZEROFIX=1``. A
small plugin imports ``transformers.trainer``, ``deepspeed`` and TRL's SFT trainer first in both runs, so that every fix in
range for the stack is really applied under accelerate's tests (``Accelerator.backward`` is wrapped on
2026-04), and writes what ``zerofix.status()`` says. Every test's outcome must be identical.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from importlib import metadata

import pytest

from zerofix import catalogue

# One stack in CI (its two runs of accelerate's suite take about 4 minutes): 2026-04, whose accelerate 1.13 runs under the
# most fixes in range (latest's 1.15.0 was measured identical both ways too: docs/development.md)
pytestmark = [pytest.mark.distributed, pytest.mark.stack("2026-04")]

SUITE = ("tests/test_grad_sync.py", "tests/test_optimizer.py", "tests/test_state_checkpointing.py",
         "tests/test_scheduler.py", "tests/test_accelerator.py")
PLUGIN = """
import json, os
import transformers.trainer, deepspeed, trl.trainer.sft_trainer  # noqa: F401 - every fix's modules imported
import zerofix

def pytest_sessionfinish(session):
    with open(os.environ["PEER_SUITE_STATUS_FILE"], "w") as f:
        json.dump({r.id: r.state for r in zerofix.status()}, f)
"""

# accelerate's own tests/test_grad_sync.py asserts that the short last window of an epoch gets loss / GAS per
# micro-batch (its manual reference divides by GAS too), which is also what its guide's per-window loss
# normalisation relies on: accelerate-short-last-window, which changes it, is opt-in, so plain ZEROFIX=1 must
# leave every outcome as it was. Opted in, test_gradient_sync_cpu_multi fails on its last iteration (measured
# on 1.15.0): the reason it is opt-in.
OPT_IN = {fix.id for fix in catalogue.FIXES if fix.opt_in}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    version = metadata.version("accelerate")
    where = tmp_path_factory.mktemp("accelerate-sdist")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                           f"accelerate=={version}", "-d", str(where)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sdist,) = where.glob("accelerate-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(where, filter="data")
    (where / "zerofix_peer_plugin.py").write_text(PLUGIN)
    return where / f"accelerate-{version}", where


def start(root, plugin_dir, tmp_path, label, env_extra, tests=SUITE):
    """Start the suite (or some of its tests) in a fresh interpreter; the two runs go side by side (2 cores, one
    each)."""
    import os

    junit, status = tmp_path / f"{label}.xml", tmp_path / f"{label}-status.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROFIX")}
    env.update({"PYTHONPATH": str(plugin_dir), "PEER_SUITE_STATUS_FILE": str(status), "CUDA_VISIBLE_DEVICES": "",
                **env_extra})
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                             "zerofix_peer_plugin", f"--junitxml={junit}", *tests], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, junit, status


def node_id(root, name: str) -> str:
    """pytest's node id of a junit name (``tests.test_x.Class::test`` or ``tests.test_x::test``)."""
    classname, test = name.split("::")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).exists():
            return "::".join([path, *parts[cut:], test])
    raise AssertionError(f"no file in the suite for {name}")


def outcomes(run) -> tuple[dict, dict, dict]:
    """({test: outcome}, {fix: state}, {test: why it failed}) of one run of the suite."""
    proc, junit, status = run
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode in (0, 1), output[-5000:]
    result, why = {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        found = {child.tag: child for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in found), "passed")
        result[name] = outcome
        if outcome in ("failure", "error"):
            why[name] = (found[outcome].text or found[outcome].get("message") or "")[-3000:]
    return result, json.loads(status.read_text()), why


GRPO = {"trl-grpo-window-normalisation", "trl-gspo-token-window-normalisation"}


def test_accelerate_suite_outcomes_are_identical_with_zerofix(suite, tmp_path):
    root, plugin_dir = suite
    off = start(root, plugin_dir, tmp_path, "off", {})
    on = start(root, plugin_dir, tmp_path, "on", {"ZEROFIX": "1"})  # what a user sets: no exclusion
    without, states_off, why_off = outcomes(off)
    with_zerofix, states_on, why_on = outcomes(on)
    assert set(states_off.values()) <= {"inactive", "not-affected", "not-installed"}, states_off
    # GRPO's entries wait for trl.trainer.grpo_trainer, which the plugin cannot import without requests
    # (not on the stacks that run this test); every other entry in range is applied.
    in_range = {fix for fix, state in states_off.items() if state == "inactive"} - OPT_IN - GRPO
    assert in_range and all(states_on[fix] == "applied" for fix in in_range), states_on
    assert all(states_on[fix] in ("disabled", "not-affected") for fix in OPT_IN), states_on
    assert all(states_on[fix] in ("applied", "pending-import", "not-affected") for fix in GRPO), states_on
    assert sum(outcome == "passed" for outcome in without.values()) >= 40, without  # the suite really ran
    differing = sorted(name for name in without.keys() | with_zerofix.keys()
                       if without.get(name) != with_zerofix.get(name))
    # A difference is zerofix's only if it comes back, the same way, every time: each differing test runs alone
    # again, without and with zerofix in turn (not side by side), twice. Nothing zerofix decides depends on timing or
    # on the machine's load, so a difference it causes shows in every run. A test of the suite that fails now and then
    # under load on its own must not read as zerofix's doing. Seen in CI: test_gradient_sync_cpu_multi, with zerofix,
    # on a busy machine (never in 60 runs alone or side by side here); and test_free_memory_dereferences_prepared_
    # components, which compares the whole machine's free memory before and after (the other CI lane's processes move
    # it): with zerofix it failed side by side, and alone it failed without zerofix and passed with it.
    seen = {name: [(without.get(name), with_zerofix.get(name))] for name in differing}
    for attempt in range(2 if differing else 0):
        tests = [node_id(root, name) for name in differing]
        again_off, _, why_again_off = outcomes(start(root, plugin_dir, tmp_path, f"off-again{attempt}", {}, tests))
        again_on, _, why_again_on = outcomes(start(root, plugin_dir, tmp_path, f"on-again{attempt}",
                                                   {"ZEROFIX": "1"}, tests))
        for name in differing:
            seen[name].append((again_off.get(name), again_on.get(name)))
            why_off.setdefault(name, why_again_off.get(name) or why_again_on.get(name, ""))
    reproduced = {name: runs for name, runs in seen.items() if all(run == runs[0] for run in runs)}
    assert not reproduced, "\n\n".join(
        f"{name}: (without zerofix, with) in each run {runs}\n{why_off.get(name) or why_on.get(name, '')}"
        for name, runs in reproduced.items())
    if differing:  # a flake of the suite itself, said where CI shows it
        import warnings

        warnings.warn("accelerate's suite differed, and not the same way in every run again: " + "; ".join(
            f"{name}: (without zerofix, with) in each run {seen[name]}: "
            f"{(why_off.get(name) or why_on.get(name, ''))[-400:]}" for name in differing))
