"""``zerofix check``: run the scenarios of ``zerofix.check.plan`` on the installed libraries, unpatched and
patched, and print one verdict per scenario (``zerofix.check.verdict``)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from zerofix.check import plan, verdict
from zerofix.versions import installed_version, version_in_range

DISTS = ("torch", "transformers", "accelerate", "deepspeed", "trl")


def versions() -> dict:
    found = {}
    for dist in ("zerofix", *DISTS, "datasets"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=None, help="ranks per multi-rank scenario (default 2)")
    p.add_argument("--quick", action="store_true", help="1 process, the fewest scenarios (under a minute)")
    p.add_argument("--only", help="comma list of scenario names or patterns (deepspeed-*) to run")
    p.add_argument("--skip", help="comma list of scenario names or patterns to leave out")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (for CI)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="for the scenarios with a bug: the loss over 20 steps, unpatched vs patched vs reference")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--workdir", help="keep every run's files here (default: a temporary directory)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")


def main(args, parser) -> int:
    if args.list:
        for s in plan.SCENARIOS:
            print(f"{s.name:<28} {s.title}{'  [quick]' if s.quick else ''}")
        return 0
    if args.quick and args.nproc not in (None, 1):
        parser.error("--quick runs 1 process; leave out --nproc")
    nproc = 1 if args.quick else (2 if args.nproc is None else args.nproc)
    if nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be a positive number of seconds")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        # Found out now, not after minutes of runs.
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"{option} {path}: the directory {Path(path).resolve().parent} does not exist")
    try:
        rows = plan.select(only=_names(args.only), skip=_names(args.skip), quick=args.quick)
    except plan.UsageError as exc:
        parser.error(str(exc))
    if not rows:
        parser.error("no scenario left to run")
    if args.plot:
        from zerofix.check import curves

        problem = curves.unavailable()
        if problem:
            parser.error(problem)
    # The check runs on CPU (the ranks' environment hides GPUs too); named, DeepSpeed does not warn that it
    # found no GPU in this process.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    start = time.time()
    found = versions()
    print(header(found, nproc), flush=True)
    try:
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            results = run_rows(rows, nproc, Path(args.workdir), args.timeout, found)
        else:
            with tempfile.TemporaryDirectory(prefix="zerofix-check-") as tmp:
                results = run_rows(rows, nproc, Path(tmp), args.timeout, found)
    except KeyboardInterrupt:
        print("\nzerofix check: interrupted (the running job's ranks were stopped)", file=sys.stderr)
        return 130
    seconds = time.time() - start
    print(table(results))
    code = verdict.exit_code(r["status"] for r in results)
    print(summary(results, seconds), flush=True)
    document = {"versions": found, "nproc": nproc, "quick": args.quick, "seconds": round(seconds, 1),
                "exit_code": code, "scenarios": results}
    if args.plot:
        from zerofix.check import curves

        message, document["curves"] = curves.plot(results, args.plot, nproc=nproc, timeout=args.timeout,
                                                  workdir=args.workdir)
        print(message)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1))
    return code


def _names(text):
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def header(found: dict, nproc: int) -> str:
    libs = ", ".join(f"{d} {found[d] or '-'}" for d in DISTS)
    return (f"zerofix check (zerofix {found['zerofix'] or '-'}): {libs}\n"
            f"{nproc} rank{'s' if nproc > 1 else ''} per multi-rank scenario, gloo on CPU; each scenario unpatched, "
            f"then patched\nratio = <update, reference> / <reference, reference> of the worst optimizer step "
            f"(1.0000 is right); reference: float64, one process, the same samples")


def skip_reason(job: plan.Job, nproc: int, found: dict) -> str | None:
    missing = [d for d in job.requires if not (found.get(d) or installed_version(d))]
    if missing:
        return f"{', '.join(missing)} not installed"
    for dist, spec, why in job.versions:
        version = found.get(dist) or installed_version(dist)
        if not version_in_range(version, spec):
            return f"{dist} {version} {why}"
    ranks = 1 if job.ranks == "1" else nproc
    if ranks < job.min_ranks:
        return f"needs {job.min_ranks} ranks (--nproc {nproc})"
    return None


def run_rows(rows, nproc: int, workdir: Path, timeout: float, found: dict) -> list[dict]:
    """Run the rows job by job (a progress bar on stderr); one result dict per row, in plan order."""
    from zerofix.check import jobs, launch

    by_job: dict[str, list] = {}
    for row in rows:
        by_job.setdefault(row.job, []).append(row)
    results = {}
    runnable = []
    for name, job_rows in by_job.items():
        reason = skip_reason(plan.JOBS[name], nproc, found)
        for row in job_rows:
            if reason:
                results[row.name] = _result(row, status="skipped", text=f"skipped: {reason}")
        if not reason:
            runnable.append((plan.JOBS[name], job_rows))
    bar = _progress(len(runnable))
    for job, job_rows in runnable:
        bar.set_description(job.name)
        ranks = 1 if job.ranks == "1" else nproc
        started = time.time()
        try:
            measured, failure = jobs.run(job, job_rows, ranks, workdir / job.name, timeout), None
        except launch.LaunchError as exc:
            measured, failure = {}, exc.tail
        except Exception as exc:  # noqa: BLE001 - one job's failure must not hide the others' results
            measured, failure = {}, f"{type(exc).__name__}: {exc}"
        for row in job_rows:
            results[row.name] = _row_result(row, measured.get(row.name), failure, round(time.time() - started, 1),
                                            found)
        bar.update(1)
    bar.close()
    return [results[row.name] for row in rows]


def _result(row, *, status, text, **extra) -> dict:
    return {"name": row.name, "title": row.title, "job": row.job, "status": status, "verdict": text,
            "unpatched": None, "patched": None, "applied": [], "fixes": list(row.fixes), "note": None, **extra}


def _row_result(row, measured, failure, seconds, found) -> dict:
    if measured is None:
        return _result(row, status="failed", text="failed", tail=failure or "no result", seconds=seconds,
                       note=verdict.known_note(row.name, found))
    tolerance = row.tolerance or verdict.TOLERANCE
    unpatched = measured["unpatched"] if row.patchable else None
    status, text = verdict.verdict(unpatched, measured["patched"], measured["applied"], tolerance)
    note = verdict.known_note(row.name, found) if status == "WRONG" else None
    return _result(row, status=status, text=text, unpatched=unpatched, patched=measured["patched"],
                   applied=measured["applied"], note=note, seconds=seconds, tolerance=tolerance)


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="job", file=sys.stderr, leave=False, dynamic_ncols=True,
                bar_format="{desc:<18} {bar} {n_fmt}/{total_fmt} jobs [{elapsed}]")


def _cells(outcome) -> tuple[str, str]:
    if outcome is None:
        return "-", "-"
    if "error" in outcome:
        return "crash", ""
    cosine = outcome.get("cosine")
    return f"{outcome['ratio']:.4f}", "-" if cosine is None else f"{cosine:.4f}"


def table(results: list[dict]) -> str:
    width = max(len("scenario"), *(len(r["name"]) for r in results)) + 2
    lines = [f"\n{'':<{width}}{'unpatched':<18}patched",
             f"{'scenario':<{width}}{'ratio':<9}{'cosine':<9}{'ratio':<9}{'cosine':<9}verdict"]
    lines.append("-" * (len(lines[-1]) + 30))
    notes: dict[str, list[str]] = {}  # note -> the rows it concerns (a failed job's tail is printed once)
    for r in results:
        if r["status"] == "skipped":
            lines.append(f"{r['name']:<{width}}{r['verdict']}")
            continue
        u, p = _cells(r["unpatched"]), _cells(r["patched"])
        for label, outcome in (("unpatched", r["unpatched"]), ("patched", r["patched"])):
            if outcome and "error" in outcome:
                notes.setdefault(f"{label}: {_one_line(outcome['error'])}", []).append(r["name"])
        if r.get("tail"):
            notes.setdefault("the job failed; the failing rank's last lines:\n    "
                             + r["tail"].replace("\n", "\n    "), []).append(r["name"])
        if r.get("note"):
            notes.setdefault(r["note"], []).append(r["name"])
        lines.append(f"{r['name']:<{width}}{u[0]:<9}{u[1]:<9}{p[0]:<9}{p[1]:<9}{r['verdict']}")
    if notes:
        lines.append("")
        lines += [f"* {', '.join(names)}: {note}" for note, names in notes.items()]
    return "\n".join(lines)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def summary(results: list[dict], seconds: float) -> str:
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = [f"{counts[s]} {s}" for s in ("ok", "fixed", "WRONG", "failed", "skipped") if counts.get(s)]
    return f"\n{', '.join(parts)}; total {seconds:.0f} s"
