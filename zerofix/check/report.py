"""``zerofix check``'s report: the header, the pre-flight line, the progress of the runs, the table of verdicts,
the summary and what to do. Reads results, runs nothing."""
from __future__ import annotations

import os
import sys

DISTS = ("torch", "transformers", "accelerate", "deepspeed", "trl")


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


def model_header(user: dict) -> str:
    """``--model`` without ``--deepspeed``: the model the Trainer rows train."""
    d = user["described"]
    return (f"your model: a tiny random {d['class']} ({d['model_type']}, {'tied' if d['tied_head'] else 'untied'} head, "
            f"{d['parameters']} parameters) from {d['source']}; the Trainer trains it at GAS={user['gas']} on one "
            "process and with DDP" + (" and FSDP2 (your --fsdp-config)" if user.get("fsdp_config") is not None else "")
            + ", no DeepSpeed")


def _op_built(extensions_dir: str) -> bool:
    import glob

    return bool(glob.glob(os.path.join(extensions_dir, "deepspeed_shm_comm", "*.so")))


def preflight(found: dict, rows) -> str:
    """One line: the prerequisites the selected scenarios need that are missing (torch for every one; a C++
    compiler for DeepSpeed, which builds its CPU communication op on first use; no lock left by an interrupted
    build, zerofix.check.host.jitlock), or that all are there."""
    import shutil

    from zerofix.check import plan

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
        from zerofix.check import launch
        from zerofix.check.host import jitlock

        env = launch.scenario_env()
        ninja = shutil.which("ninja", path=env["PATH"])
        if ninja is None:
            problems.append("no ninja on the ranks' PATH: DeepSpeed builds its CPU communication op with it, so its "
                            "scenarios will fail (pip install ninja in this environment, or apt-get install "
                            "ninja-build)")
        problems += jitlock.clear_stale(env["TORCH_EXTENSIONS_DIR"])
        if ninja and not problems and not _op_built(env["TORCH_EXTENSIONS_DIR"]):
            present.append("DeepSpeed's CPU op is not built yet: the first DeepSpeed run builds it, 30 - 120 s "
                           "of both cores, once per environment")
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


def header(found: dict, nproc: int) -> str:
    libs = ", ".join(f"{d} {found[d] or '-'}" for d in DISTS)
    return (f"zerofix check (zerofix {found['zerofix'] or '-'}): {libs}\n"
            f"{nproc} rank{'s' if nproc > 1 else ''} per multi-rank scenario, gloo on CPU; each scenario unpatched, "
            f"then patched\nratio = <update, reference> / <reference, reference> of the worst optimizer step "
            f"(1.0000 is right); reference: float64, one process, the same samples")


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


class _LineBar:
    """Progress as whole lines, for a log file or a CI's output (what tqdm and pip do there): one line per run as
    it starts, numbered as they start (two sessions run side by side: a run may start before the one before it ends),
    no carriage returns."""

    def __init__(self, total: int, stream=None):
        self.total, self.started, self.stream = total, 0, stream or sys.stderr

    def set_description(self, name):
        self.started += 1
        self.stream.write(f"zerofix check: run {self.started}/{self.total}: {name}\n")
        self.stream.flush()

    def update(self, n):
        pass

    def close(self):
        pass


def progress(total: int, stream=None):
    """What shows the runs' progress on stderr: tqdm's bar on a terminal, whole lines elsewhere."""
    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return _LineBar(total, stream)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", file=sys.stderr, leave=False, dynamic_ncols=True,
                bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} runs [{elapsed}]")


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
