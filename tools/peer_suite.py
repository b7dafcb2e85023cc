"""Run an upstream project's own tests twice, without zerofix and with ``ZEROFIX=1``, and compare every outcome.

Upstream's test suites are zerofix's peers: every test must end the same way with and without zerofix (do no
harm). DeepSpeed's unit tests are not in its sdist, so they come from a checkout of its repository (any
source of the tree: ``git archive``, a release tarball); nothing of it is kept in this repository.

    python tools/peer_suite.py --root /path/to/DeepSpeed/tests --python .venvs/latest/bin/python \\
        --env DS_ACCELERATOR=cpu --env LOCAL_SIZE=2 -- unit/runtime/test_no_sync_ctxt.py

``--root`` is the directory pytest runs in (DeepSpeed: its ``tests`` folder, whose conftest puts ``unit`` on the
path). The two runs go one after the other (DeepSpeed's distributed tests start their own ranks); each writes a
JUnit file. Prints one Markdown table (test, outcome without, outcome with, same?) and a summary line; exits 1
when any outcome differs, 2 when a run could not start. ``--json`` also saves the outcomes.

The interpreter must have zerofix installed with its ``.pth`` start-up hook (an editable install does), so
that ``ZEROFIX=1`` patches every process DeepSpeed's tests start, as it would a user's ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("failure", "error", "skipped")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, type=Path, help="the directory pytest runs in (upstream's tests)")
    p.add_argument("--python", default=sys.executable, help="the stack's interpreter (zerofix installed)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment, both runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--json", type=Path, default=None, help="also write the outcomes here")
    p.add_argument("--title", default="", help="a line printed above the table")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: test files, -k, ...")
    args = p.parse_args(argv)
    args.pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if not args.pytest_args:
        p.error("name the tests to run after --, e.g. -- unit/runtime/test_no_sync_ctxt.py")
    if not args.root.is_dir():
        p.error(f"--root {args.root} is not a directory: give the folder upstream's tests run from")
    for item in args.env:
        if "=" not in item:
            p.error(f"--env {item!r}: write NAME=VALUE")
    if os.sep in args.python:  # pytest runs in --root: a relative interpreter path must not depend on it
        args.python = os.path.abspath(args.python)  # (abspath, not resolve: a venv's python is a symlink)
    return args


def run(args, label: str, zerofix: dict, workdir: Path) -> tuple[dict, float]:
    """One run of the suite; returns {test id: outcome} and its seconds."""
    junit = workdir / f"{label}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROFIX")}
    env.update(dict(item.split("=", 1) for item in args.env))
    env.update(zerofix)
    started = time.monotonic()
    proc = subprocess.run([args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           *args.pytest_args], cwd=args.root, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    seconds = time.monotonic() - started
    if proc.returncode not in (0, 1) or not junit.exists():  # 0 passed, 1 some failed; else it did not run
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"peer_suite: the {label} run exited {proc.returncode} without a result")
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = next((k for k in OUTCOMES if k in kinds), "passed")
    return outcomes, seconds


def table(without: dict, with_zerofix: dict) -> tuple[list[str], int]:
    lines = ["| test | without zerofix | with `ZEROFIX=1` | same |", "|---|---|---|---|"]
    differ = 0
    for test in sorted(set(without) | set(with_zerofix)):
        a, b = without.get(test, "absent"), with_zerofix.get(test, "absent")
        differ += a != b
        lines.append(f"| `{test}` | {a} | {b} | {'yes' if a == b else '**no**'} |")
    return lines, differ


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zerofix-peer-") as tmp:
        without, t_off = run(args, "without", {}, Path(tmp))
        with_zerofix, t_on = run(args, "with", {"ZEROFIX": "1"}, Path(tmp))
    lines, differ = table(without, with_zerofix)
    if args.title:
        print(args.title + "\n")
    print("\n".join(lines))
    counts = {o: sum(v == o for v in without.values()) for o in ("passed", *OUTCOMES)}
    print(f"\n{len(without)} tests ({', '.join(f'{n} {o}' for o, n in counts.items() if n)} without zerofix); "
          f"{differ} differ with ZEROFIX=1; {t_off:.0f} s without, {t_on:.0f} s with")
    if args.json:
        args.json.write_text(json.dumps({"without": without, "with": with_zerofix}, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
