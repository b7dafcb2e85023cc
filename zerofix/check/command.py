"""``zerofix check``: run the scenarios of ``zerofix.check.plan`` on the installed libraries, unpatched and
patched, and print one verdict per scenario (``zerofix.check.verdict``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from zerofix.check import plan, userconfig, verdict
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number (1 or more)")
    return value


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=_positive_int, default=None, help="ranks per multi-rank scenario (default 2)")
    p.add_argument("--quick", action="store_true", help="1 process, the fewest scenarios (15 s on 2 cores)")
    p.add_argument("--only", help="comma list of scenario names or patterns (deepspeed-*) to run")
    p.add_argument("--skip", help="comma list of scenario names or patterns to leave out")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (for CI)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="for the scenarios with a bug: the loss over 20 steps, unpatched vs patched vs reference")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--workdir", help="keep every run's files here (default: a temporary directory)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    own = p.add_argument_group("your configuration", "run the scenarios that concern your run with its settings: "
                               "--deepspeed with your DeepSpeed config file, and any of the options below (the README "
                               "of zerofix's repository, 'Check your own configuration', has an example)")
    own.add_argument("--deepspeed", metavar="DS_CONFIG.json", help="your DeepSpeed config (\"auto\" values are "
                     "resolved as the Trainer resolves them)")
    own.add_argument("--gas", type=_positive_int,
                     help="your gradient accumulation steps (default: the config's, else 4)")
    own.add_argument("--bf16", action="store_true", help="your run trains in bf16 (bf16.enabled \"auto\")")
    own.add_argument("--fp16", action="store_true", help="your run trains in fp16 (not reproducible on CPU)")
    own.add_argument("--model", metavar="PATH", help="a local model directory or config.json: the scenarios train a "
                     "tiny random model of the same class (nothing is downloaded)")
    own.add_argument("--trainer-args", metavar="ARGS.json", help="your TrainingArguments as JSON "
                     "(TrainingArguments.to_json_string()): GAS, batch size, max_grad_norm, "
                     "average_tokens_across_devices")


def main(args, parser) -> int:
    if args.list:
        return _list(args, parser)
    own = [f"--{name.replace('_', '-')}" for name in ("gas", "bf16", "fp16", "model", "trainer_args")
           if getattr(args, name) not in (None, False)]
    if own and not args.deepspeed:
        said = " and ".join(own)
        parser.error(f"{said} {'describes' if len(own) == 1 else 'describe'} your own run, which needs its DeepSpeed "
                     f"config too: add --deepspeed DS_CONFIG.json (or leave out {said} for the built-in scenarios)")
    if args.deepspeed and args.quick:
        parser.error("--quick runs the built-in scenarios; leave it out with --deepspeed")
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
    # A temporary directory is removed at the end unless a job failed (its launcher.log is the full story).
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="zerofix-check-"))
    try:
        user = _user_setup(args, nproc, workdir) if args.deepspeed else None
        rows = plan.select(only=_names(args.only), skip=_names(args.skip), quick=args.quick,
                           rows=user["rows"] if user else None)
    except (plan.UsageError, userconfig.ConfigError) as exc:
        _remove(workdir, args)
        parser.error(str(exc))
    if not rows:
        _remove(workdir, args)
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
    if user:
        print(user_header(user), flush=True)
    print(preflight(found, rows), flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run_rows(rows, nproc, workdir, args.timeout, found, user=user)
    except KeyboardInterrupt:
        print("\nzerofix check: interrupted (the running job's ranks were stopped)", file=sys.stderr)
        _remove(workdir, args)
        return 130
    seconds = time.time() - start
    print(table(results))
    code = verdict.exit_code(r["status"] for r in results)
    print(summary(results, seconds), flush=True)
    print(advice(results), flush=True)
    if any(r["status"] == "failed" for r in results) and not args.workdir:
        print(f"The failed jobs' full logs are kept: {workdir}/<job>/launcher.log", flush=True)
    elif not args.workdir:
        _remove(workdir, args)
    document = {"versions": found, "nproc": nproc, "quick": args.quick, "seconds": round(seconds, 1),
                "exit_code": code, "scenarios": results}
    if user:
        cfg = user["config"]
        document["configuration"] = {"file": cfg.path, "resolved": cfg.ds, "summary": cfg.summary(),
                                     "notes": list(cfg.notes), "unreproducible": list(cfg.unreproducible),
                                     "model": user["described"]}
    if args.plot:
        from zerofix.check import curves

        message, document["curves"] = curves.plot(results, args.plot, nproc=nproc, timeout=args.timeout,
                                                  workdir=args.workdir)
        print(message)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1))
    return code


def _list(args, parser) -> int:
    """The rows a run with these arguments would train: the built-in scenarios, or with --deepspeed the rows for
    that configuration (its --model built, so a classifier lists its own Trainer row)."""
    rows = plan.SCENARIOS
    if args.deepspeed:
        workdir = Path(tempfile.mkdtemp(prefix="zerofix-check-list-"))
        try:
            rows = _user_setup(args, args.nproc or 2, workdir)["rows"]
        except userconfig.ConfigError as exc:
            parser.error(str(exc))
        finally:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    try:
        chosen = {r.name for r in plan.select(only=_names(args.only), skip=_names(args.skip), quick=args.quick,
                                               rows=rows)}
    except plan.UsageError as exc:
        parser.error(str(exc))
    for s in rows:
        if s.name in chosen:
            print(f"{s.name:<28} {s.title}{'  [quick]' if s.quick else ''}")
    return 0


def _remove(workdir: Path, args) -> None:
    if not args.workdir:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def _user_setup(args, nproc: int, workdir: Path) -> dict:
    """Resolve ``--deepspeed`` (and ``--trainer-args``, ``--model``): the configuration, the model the rows
    train, and the rows. Raises userconfig.ConfigError for anything unusable."""
    cfg = userconfig.load(args.deepspeed, gas=args.gas, nproc=nproc, bf16=args.bf16, fp16=args.fp16,
                          trainer_args=args.trainer_args)
    described, model, tied = None, "causal-lm", False
    if args.model:
        if not installed_version("transformers") or not installed_version("torch"):
            raise userconfig.ConfigError("--model builds a transformers model: install torch and transformers")
        from zerofix.check import usermodel

        model, described = usermodel.prepare(args.model, workdir / "model")
        tied = described["tied_head"]
    average_tokens = cfg.average_tokens
    if average_tokens is None and installed_version("transformers"):
        # the installed release's default, as the user's run gets it when it does not set the field
        import dataclasses

        from transformers import TrainingArguments

        average_tokens = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}.get(
            "average_tokens_across_devices", False)
    task = described["task"] if described else "token"
    rows = plan.user_scenarios(cfg, model_name=described and described["class"], tied=tied, task=task)
    return {"config": cfg, "model": model, "tied": tied, "described": described, "task": task,
            "average_tokens": bool(average_tokens), "rows": rows}


def user_header(user: dict) -> str:
    cfg = user["config"]
    lines = [f"your configuration: {cfg.path}: {cfg.summary()}"]
    if user["described"]:
        d = user["described"]
        lines.append(f"your model: a tiny random {d['class']} ({d['model_type']}, {'tied' if d['tied_head'] else 'untied'} "
                     f"head, {d['parameters']} parameters) from {d['source']}")
    lines += [f"  - {note}" for note in cfg.notes]
    lines += [f"  - not reproducible on CPU: {what}" for what in cfg.unreproducible]
    return "\n".join(lines)


def preflight(found: dict, rows) -> str:
    """One line: the prerequisites the selected scenarios need that are missing (torch for every one; a C++
    compiler for DeepSpeed, which builds its CPU communication op on first use; no lock left by an interrupted
    build, zerofix.check.jitlock), or that all are there."""
    import shutil

    needs_deepspeed = any("deepspeed" in plan.job(r.job).requires for r in rows)
    problems, present = [], []
    if not found.get("torch"):
        problems.append("torch is not installed: every scenario is skipped (pip install torch; see the README's "
                        "quick start)")
    if needs_deepspeed and found.get("deepspeed"):
        compiler = os.environ.get("CXX") or "c++"
        located = shutil.which(compiler) or (None if os.environ.get("CXX") else shutil.which("g++"))
        if located:
            present.append(f"C++ compiler {located}")
        else:
            problems.append(f"no C++ compiler ({'$CXX=' + compiler if os.environ.get('CXX') else 'c++ or g++'} not "
                            "found): DeepSpeed builds its CPU communication op with one, so its scenarios will fail "
                            "(install g++, e.g. apt-get install g++)")
    if needs_deepspeed and found.get("deepspeed"):
        from zerofix.check import jitlock, launch

        problems += jitlock.clear_stale(launch.scenario_env()["TORCH_EXTENSIONS_DIR"])
    if problems:
        return "pre-flight: " + "; ".join(problems)
    return "pre-flight: ok" + (f" ({', '.join(present)})" if present else "")


def advice(results: list[dict]) -> str:
    """What to do, from the verdicts: which fixes this run needs (and the upstream release that has each fix),
    or that nothing is needed, or what a WRONG / failed row asks for."""
    from zerofix import catalogue

    by_id = {f.id: f for f in catalogue.FIXES}
    needed = []
    for r in results:
        if r["status"] == "fixed":
            needed += [f for f in r["applied"] if f not in needed]
    lines = ["What to do:"]
    if needed:
        lines.append("- keep zerofix active in this run (ZEROFIX=1, or zerofix.patch() at the top of the script); "
                     "it applies:")
    for fix_id in needed:
        fix = by_id[fix_id]
        upstream = (f"fixed upstream in {fix.dist} {fix.fixed_in}: upgrading fixes it too" if fix.fixed_in
                    else "no upstream release fixes it yet")
        lines.append(f"  {fix_id} ({upstream})")
    if any(r["status"] == "WRONG" for r in results):
        lines.append("- WRONG rows train a gradient other than the one meant, with zerofix too: do not trust those "
                     "runs' updates; report it with the --json output")
    if any(r["status"] == "failed" for r in results):
        lines.append("- failed rows could not be measured: the reason is under the table")
    if len(lines) == 1:
        ran = [r for r in results if r["status"] != "skipped"]
        lines.append("- nothing: every scenario that ran is right without zerofix" if ran
                     else "- nothing ran: see the skip reasons above")
    return "\n".join(lines)


def _names(text):
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def header(found: dict, nproc: int) -> str:
    libs = ", ".join(f"{d} {found[d] or '-'}" for d in DISTS)
    return (f"zerofix check (zerofix {found['zerofix'] or '-'}): {libs}\n"
            f"{nproc} rank{'s' if nproc > 1 else ''} per multi-rank scenario, gloo on CPU; each scenario unpatched, "
            f"then patched\nratio = <update, reference> / <reference, reference> of the worst optimizer step "
            f"(1.0000 is right); reference: float64, one process, the same samples")


def skip_reason(job: plan.Job, nproc: int, found: dict, unreproducible=()) -> str | None:
    if unreproducible:
        return "not reproducible on CPU: " + "; ".join(unreproducible)
    # every scenario trains with torch (and its launcher is torch's)
    missing = [d for d in ("torch", *job.requires) if not (found.get(d) or installed_version(d))]
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


def run_rows(rows, nproc: int, workdir: Path, timeout: float, found: dict, user: dict | None = None) -> list[dict]:
    """Run the rows job by job (a progress bar on stderr); one result dict per row, in plan order. ``user``:
    a user's configuration (``--deepspeed``), which the rows' jobs train with."""
    by_job: dict[str, list] = {}
    for row in rows:
        by_job.setdefault(row.job, []).append(row)
    results = {}
    runnable = []
    for name, job_rows in by_job.items():
        reason = skip_reason(plan.job(name), nproc, found, user["config"].unreproducible if user else ())
        for row in job_rows:
            if reason:
                results[row.name] = _result(row, status="skipped", text=f"skipped: {reason}")
        if not reason:
            runnable.append((plan.job(name), job_rows))
    if runnable:  # torch is installed: the jobs can be imported
        _run_jobs(runnable, nproc, workdir, timeout, found, user, results)
    return [results[row.name] for row in rows]


def _run_jobs(runnable, nproc, workdir, timeout, found, user, results) -> None:
    from zerofix.check import jobs, launch

    bar = _progress(len(runnable))
    for job, job_rows in runnable:
        bar.set_description(job.name)
        ranks = 1 if job.ranks == "1" else nproc
        started = time.time()
        try:
            measured, failure = jobs.run(job, job_rows, ranks, workdir / job.name, timeout, user=user), None
        except launch.LaunchError as exc:
            measured, failure = {}, exc.tail
        except Exception as exc:  # noqa: BLE001 - one job's failure must not hide the others' results
            measured, failure = {}, f"{type(exc).__name__}: {exc}"
        for row in job_rows:
            results[row.name] = _row_result(row, measured.get(row.name), failure, round(time.time() - started, 1),
                                            found)
        bar.update(1)
    bar.close()


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


class _LineBar:
    """Progress as whole lines, for a log file or a CI's output (what tqdm and pip do there): one line per job as
    it starts, no carriage returns."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr

    def set_description(self, name):
        self.stream.write(f"zerofix check: job {self.done + 1}/{self.total}: {name}\n")
        self.stream.flush()

    def update(self, n):
        self.done += n

    def close(self):
        pass


def _progress(total: int, stream=None):
    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return _LineBar(total, stream)
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
            notes.setdefault("the job failed:\n    "
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
