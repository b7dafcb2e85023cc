"""Every run time and pasted output the user-facing pages show, from one measured file (issue 42, item 5).

    python tools/figures.py measure [NAME ...]   # run the measurements (all, or those named), write docs/figures.json
    python tools/figures.py from-ci CI.log       # CI's total and per-step times, from a log of `.ci/run`
    python tools/figures.py set NAME VALUE --how TEXT   # a figure measured elsewhere (say where in --how)
    python tools/figures.py render               # rewrite the marked places of the pages from docs/figures.json
    python tools/figures.py check                # exit 1, naming each place that differs (tests/test_figures.py)

A page marks a figure inline as ``<!-- fig NAME -->TEXT<!-- /fig -->`` and a pasted output as a marker line
``<!-- check-output: STACK -->``, ``<!-- own-config-output: STACK CONFIG -->`` or ``<!-- trl-rows: STACK -->``
(optionally ``(no header)``: without the command line and the three version lines) followed by a fenced block. ``render`` writes TEXT and the blocks from docs/figures.json; ``check`` says where a page
differs, so a page cannot drift from the last measurement. Each figure records when, on what and how it was measured.
Measurements run on this machine with the stacks' environments (``make venv STACK=...``), one at a time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
PAGES = ("README.md", "docs/check.md", "docs/development.md", "docs/benchmarks.md")
INLINE = re.compile(r"<!-- fig (?P<name>[\w.-]+) -->(?P<text>.*?)<!-- /fig -->")
BLOCK = re.compile(r"^<!-- (?P<name>(?:check-output|own-config-output|trl-rows): [\w. -]+?)(?P<headless> \(no header\))? -->"
                   r"\n```\n(?P<text>.*?)```", re.M | re.S)
# The user-style ZeRO-2 + CPU optimizer offload configuration of the own-configuration outputs (docs/check.md)
OWN_CONFIG = ROOT / "docs" / "measured" / "ds_config_zero2_offload.json"


def text_of(figure: dict) -> str:
    """A figure as the pages write it."""
    value, unit = figure["value"], figure["unit"]
    if unit == "s":
        return f"{value:g} s"
    if unit == "s+min":  # a long run: seconds, and minutes for the reader
        return f"{value:g} s ({value / 60:.0f} min)"
    if unit == "ms":  # a per-step cost (benchmarks/bench_overhead.py)
        return f"{value:g} ms"
    if unit == "us":
        return f"{value:g} µs"
    if unit == "min":
        return f"{value:g} minutes"
    raise ValueError(f"unknown unit {unit!r}")


def headless(output: str) -> str:
    """A check's output without the command line and its three version/explanation lines."""
    lines = output.splitlines()
    if lines and lines[0].startswith("$ "):
        lines = lines[1:]
    return "\n".join(lines[3:]) + "\n"


def load() -> dict:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {"figures": {}, "outputs": {}}


def save(data: dict) -> None:
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def rendered(page: str, data: dict) -> tuple[str, list[str]]:
    """The page with every marked place written from ``data``, and the names it marks that ``data`` lacks."""
    missing = []

    def inline(m):
        figure = data["figures"].get(m["name"])
        if figure is None:
            missing.append(m["name"])
            return m[0]
        return f"<!-- fig {m['name']} -->{text_of(figure)}<!-- /fig -->"

    def block(m):
        output = data["outputs"].get(m["name"])
        if output is None:
            missing.append(m["name"])
            return m[0]
        body = headless(output["text"]) if m["headless"] else output["text"]
        return f"<!-- {m['name']}{m['headless'] or ''} -->\n```\n{body}```"

    return BLOCK.sub(block, INLINE.sub(inline, page)), missing


def differences(data: dict | None = None) -> list[str]:
    """Each page whose marked places differ from the measured file, and each name no measurement has."""
    data = data or load()
    out = []
    for name in PAGES:
        page = (ROOT / name).read_text()
        new, missing = rendered(page, data)
        out += [f"{name}: {m} is marked but not measured (docs/figures.json)" for m in missing]
        if new != page:
            out.append(f"{name}: differs from docs/figures.json (python tools/figures.py render)")
    return out


def used_names() -> set[str]:
    names = set()
    for name in PAGES:
        page = (ROOT / name).read_text()
        names |= {m["name"] for m in INLINE.finditer(page)} | {m["name"] for m in BLOCK.finditer(page)}
    return names


# -- measurements ------------------------------------------------------------------------------------------------

def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def _timed(cmd, cwd=ROOT, env=None) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds, proc.stdout


def _total(output: str) -> float:
    found = re.findall(r"; total (\d+(?:\.\d+)?) s", output)
    if not found:
        raise SystemExit("no 'total N s' line in the check's output")
    return float(found[-1])


def _record(data, name, value, unit, how, output=None):
    stamp = {"measured": datetime.date.today().isoformat(), "commit": _commit(), "machine": _machine(), "how": how}
    data["figures"][name] = {"value": value, "unit": unit, **stamp}
    if output is not None:
        data["outputs"][output[0]] = {"text": output[1], **stamp}


def _machine() -> str:
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"


def _zerofix(stack: str) -> str:
    path = ROOT / ".venvs" / stack / "bin" / "zerofix"
    if not path.exists():
        raise SystemExit(f"{path} is missing: make venv STACK={stack} first")
    return str(path)


def _check_output(stack: str, *argv, cwd=None) -> tuple[float, str]:
    _, out = _timed([_zerofix(stack), "check", *argv], cwd=cwd or ROOT)
    return _total(out), out.rstrip("\n") + "\n"


def measure_status(data):
    runs = [_timed([_zerofix("2026-04"), "status"])[0] for _ in range(5)]
    _record(data, "status_s", round(statistics.median(runs), 1), "s", "zerofix status on 2026-04, median of 5")


def measure_check_2026_04(data):
    total, out = _check_output("2026-04")
    _record(data, "check_2026_04_s", total, "s", "zerofix check on 2026-04 (make check), op built: its total",
            ("check-output: 2026-04", out))


def measure_check_latest(data):
    total, out = _check_output("latest")
    _record(data, "check_latest_s", total, "s", "zerofix check on latest, op built: its total",
            ("check-output: latest", out))


def measure_check_quick(data):
    total, _ = _check_output("latest", "--quick")
    _record(data, "check_quick_latest_s", total, "s", "zerofix check --quick on latest, op built: its total")


def measure_own_config(data):
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(OWN_CONFIG, Path(tmp) / "ds_config.json")
        total, out = _check_output("2026-04", "--deepspeed", "ds_config.json", "--gas", "4", cwd=tmp)
    _record(data, "own_config_2026_04_s", total, "s",
            f"zerofix check --deepspeed ds_config.json --gas 4 on 2026-04 ({OWN_CONFIG.relative_to(ROOT)})",
            ("own-config-output: 2026-04 zero2-offload", "$ zerofix check --deepspeed ds_config.json --gas 4\n" + out))


def measure_trl_rows(data):
    """`zerofix check --only 'trl-*'` on the TRL stacks, without its "What to do" (docs/check.md)."""
    for stack in ("trl160", "trl1100", "trl1142"):
        total, out = _check_output(stack, "--only", "trl-*")
        rows = out.split("What to do:")[0].rstrip("\n") + "\n"
        _record(data, f"check_trl_rows_{stack}_s", total, "s", f"zerofix check --only 'trl-*' on {stack}: its total",
                (f"trl-rows: {stack}", rows))


def measure_make_test(data):
    seconds, _ = _timed(["make", "test", "STACK=latest"])
    _record(data, "make_test_s", round(seconds), "s", "make test STACK=latest, environment built, op built")


def measure_bench(data):
    for target, name in (("bench", "bench_s"), ("bench-ds", "bench_ds_s")):
        seconds, _ = _timed(["make", target, "STACK=latest"])
        _record(data, name, round(seconds), "s", f"make {target} STACK=latest")


def measure_fresh_clone(data):
    """`make check` then `make test` in a fresh clone: environments built (from uv's cache here), op compiled."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "clone", "-q", str(ROOT), tmp], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        check_s, _ = _timed(["make", "check"], cwd=tmp, env=env)
        test_s, _ = _timed(["make", "test"], cwd=tmp, env=env)
    _record(data, "fresh_make_check_s", round(check_s), "s", "make check on a fresh clone (environment built "
            "from uv's cache, DeepSpeed's CPU op compiled)")
    _record(data, "fresh_make_test_s", round(test_s), "s", "make test after it on that clone (the latest "
            "environment built, the fast tier's first run)")


MEASUREMENTS = {"status": measure_status, "check-2026-04": measure_check_2026_04, "check-latest": measure_check_latest,
                "check-quick": measure_check_quick, "own-config": measure_own_config, "trl-rows": measure_trl_rows, "make-test": measure_make_test,
                "bench": measure_bench, "fresh-clone": measure_fresh_clone}

# not anchored at a line's start: a pytest run's last output may lack its newline (Triton's nanobind leak report at exit)
CI_STEP = re.compile(r"== (?:\[\w\] )?make (?P<target>[\w-]+) STACK=(?P<stack>[\w.-]+): exit 0 in (?P<s>\d+) s$", re.M)


def from_ci(data, log: str, how: str):
    """CI's total and the full tier's time on latest (its two steps), from a log of `.ci/run`."""
    total = re.search(r"^CI done in (\d+) s(?: \(exit 0\))?$", log, re.M)
    if not total:
        raise SystemExit("no 'CI done in N s' line: a log of a whole, green `.ci/run` is needed")
    steps = {(m["target"], m["stack"]): int(m["s"]) for m in CI_STEP.finditer(log)}
    _record(data, "ci_s", int(total[1]), "s+min", how)
    latest = steps.get(("test", "latest"), 0) + steps.get(("test-rest", "latest"), 0)
    _record(data, "ci_full_tier_latest_s", latest, "s+min", how + ": make test + make test-rest on latest")
    for (target, stack), seconds in steps.items():
        if target == "test-all":
            _record(data, f"ci_{stack}_s", seconds, "s", how + f": make test-all STACK={stack}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("names", nargs="*", help=f"of {', '.join(MEASUREMENTS)} (default: all)")
    c = sub.add_parser("from-ci")
    c.add_argument("log")
    c.add_argument("--how", default="CI (.ci/run) on a fresh clone, this machine")
    s = sub.add_parser("set")
    s.add_argument("name")
    s.add_argument("value", type=float)
    s.add_argument("--unit", default="s", choices=("s", "s+min", "min", "ms", "us"))
    s.add_argument("--how", required=True)
    sub.add_parser("render")
    sub.add_parser("check")
    args = p.parse_args(argv)
    data = load()
    if args.command == "check":
        problems = differences(data)
        print("\n".join(problems) or "every marked figure and output matches docs/figures.json")
        return 1 if problems else 0
    if args.command == "render":
        for name in PAGES:
            page = (ROOT / name).read_text()
            new, missing = rendered(page, data)
            for miss in missing:
                print(f"{name}: {miss} is marked but not measured", file=sys.stderr)
            if new != page:
                (ROOT / name).write_text(new)
                print(f"rendered {name}")
        return 0
    if args.command == "measure":
        unknown = [n for n in args.names if n not in MEASUREMENTS]
        if unknown:
            p.error(f"unknown measurement(s) {unknown}: choose from {', '.join(MEASUREMENTS)}")
        for name in args.names or MEASUREMENTS:
            print(f"measuring {name} ...", flush=True)
            MEASUREMENTS[name](data)
            save(data)  # after each: a later one that fails keeps what was measured
    elif args.command == "from-ci":
        from_ci(data, Path(args.log).read_text(), args.how)
    else:
        value = int(args.value) if args.value.is_integer() else args.value
        _record(data, args.name, value, args.unit, args.how)
    save(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
