"""``zerofix check``: run the scenarios of ``zerofix.check.plan`` on the installed libraries, unpatched and
patched, and print one verdict per scenario (``zerofix.check.verdict``).

One pipeline, one place per stage: the arguments (this module: parsed and checked once, into the values the
stages take) -> the plan (``plan.make``: the rows, why some are skipped, a user's configuration) -> the run and
its results (``measure.run``: every row's requests in one batch of sessions, each row read and judged) -> the
report (``report``: table, summary, advice; JSON and ``--plot`` here)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from zerofix.check import plan, report, userconfig, verdict

DISTS = report.DISTS


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
    p.add_argument("--quick", action="store_true", help="1 process, the fewest scenarios (its time on 2 cores: docs/check.md)")
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
    own.add_argument("--fsdp-config", metavar="FSDP_CONFIG.json", help="your TrainingArguments.fsdp_config (a JSON "
                     "object): the Trainer's FSDP rows train with it (FSDP2 runs on CPU through accelerate's own FSDP "
                     "code; FSDP1 needs a GPU)")
    own.add_argument("--trainer-args", metavar="ARGS.json", help="your TrainingArguments as JSON "
                     "(TrainingArguments.to_json_string()): GAS, batch size, max_grad_norm, "
                     "average_tokens_across_devices")


def main(args, parser) -> int:
    if args.list:
        return _list(args, parser)
    nproc = _check_arguments(args, parser)
    # One OpenMP thread for this process's own torch (the references, the models --model describes), set before
    # anything here imports torch: with one per core, OpenMP's idle threads spin between the references' small
    # ops, on the cores the ranks train on (measured on 2 cores: 24 CPU s here instead of 7, the run 26 s -> 19 s).
    os.environ["OMP_NUM_THREADS"] = "1"
    # A temporary directory is removed at the end unless a job failed (its session log is the full story).
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="zerofix-check-"))
    found = versions()
    try:
        fsdp = plan.fsdp_setup(args.fsdp_config) if args.fsdp_config else None
        if args.deepspeed:
            user = _user(args, nproc, workdir)
        elif args.model:  # issue 59, item 4: the user's model on one process, DDP (and FSDP2 with --fsdp-config)
            user = plan.model_setup(args.model, workdir=workdir, gas=args.gas, fsdp_config=fsdp)
            fsdp = None if user["fsdp_config"] is None else fsdp
        else:
            user = None
        rows = plan.select(only=_names(args.only) or (["trainer-fsdp2-*"] if fsdp else None), skip=_names(args.skip),
                           quick=args.quick, rows=user["rows"] if user else None)
    except (plan.UsageError, userconfig.ConfigError) as exc:
        _remove(workdir, args)
        parser.error(str(exc))
    if not rows:
        _remove(workdir, args)
        parser.error("no scenario left to run")
    checked = plan.make(rows, nproc, found, user or fsdp)
    # The check runs on CPU (the ranks' environment hides GPUs too); named, DeepSpeed does not warn that it
    # found no GPU in this process.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    start = time.time()
    print(report.header(found, nproc), flush=True)
    if user:
        print(report.user_header(user) if "config" in user else report.model_header(user), flush=True)
    if fsdp:
        print(f"your FSDP configuration: {args.fsdp_config}: {json.dumps(fsdp['fsdp_config'], sort_keys=True)}",
              flush=True)
    print(report.preflight(found, rows), flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        from zerofix.check import measure

        timings = {}
        results = measure.run(checked, workdir=workdir, timeout=args.timeout, found=found, progress=report.progress,
                              timings=timings)
    except KeyboardInterrupt:
        print("\nzerofix check: interrupted (the running ranks were stopped)", file=sys.stderr)
        _remove(workdir, args)
        return 130
    seconds = time.time() - start
    print(report.table(results))
    code = verdict.exit_code(r["status"] for r in results)
    print(report.summary(results, seconds), flush=True)
    print(report.advice(results), flush=True)
    if any(r["status"] == "failed" for r in results) and not args.workdir:
        print(f"The failed rows' full logs are kept: {workdir}/runs/session-<ranks>/launch<n>/session.log", flush=True)
    elif not args.workdir:
        _remove(workdir, args)
    document = {"versions": found, "nproc": nproc, "quick": args.quick, "seconds": round(seconds, 1),
                "exit_code": code, "scenarios": results, "timings": timings}
    if user and "config" in user:
        cfg = user["config"]
        document["configuration"] = {"file": cfg.path, "resolved": cfg.ds, "summary": cfg.summary(),
                                     "notes": list(cfg.notes), "unreproducible": list(cfg.unreproducible),
                                     "model": user["described"]}
    elif user:  # --model alone
        document["configuration"] = {"model": user["described"], "gas": user["gas"]}
    if args.plot:
        from zerofix.check import curves

        message, document["curves"] = curves.plot(results, args.plot, nproc=nproc, timeout=args.timeout,
                                                  workdir=args.workdir)
        print(message)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1))
    return code


def _check_arguments(args, parser) -> int:
    """Every usage error found now, not after minutes of runs; returns the number of ranks."""
    own = [f"--{name.replace('_', '-')}" for name in ("bf16", "fp16", "trainer_args")
           if getattr(args, name) not in (None, False)]
    if args.gas is not None and not args.model:
        own.insert(0, "--gas")
    if own and not args.deepspeed:
        said = " and ".join(own)
        parser.error(f"{said} {'describes' if len(own) == 1 else 'describe'} your own run, which needs its DeepSpeed "
                     f"config too: add --deepspeed DS_CONFIG.json (or leave out {said} for the built-in scenarios; "
                     "--model and --gas run without it: the Trainer on one process and DDP)")
    if args.model and args.quick:
        parser.error("--quick runs the built-in scenarios; leave it out with --model")
    if args.deepspeed and args.quick:
        parser.error("--quick runs the built-in scenarios; leave it out with --deepspeed")
    if args.fsdp_config and (args.deepspeed or args.quick):
        parser.error("--fsdp-config runs the Trainer's FSDP rows; leave out --deepspeed and --quick")
    if args.quick and args.nproc not in (None, 1):
        parser.error("--quick runs 1 process; leave out --nproc")
    nproc = 1 if args.quick else (2 if args.nproc is None else args.nproc)
    if args.timeout <= 0:
        parser.error("--timeout must be a positive number of seconds")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"{option} {path}: the directory {Path(path).resolve().parent} does not exist")
    if args.plot:
        from zerofix.check import curves

        problem = curves.unavailable()
        if problem:
            parser.error(problem)
    return nproc


def _user(args, nproc: int, workdir: Path) -> dict:
    return plan.user_setup(args.deepspeed, nproc=nproc, workdir=workdir, gas=args.gas, bf16=args.bf16, fp16=args.fp16,
                           trainer_args=args.trainer_args, model_path=args.model)


def _list(args, parser) -> int:
    """The rows a run with these arguments would train: the built-in scenarios, or with --deepspeed the rows for
    that configuration (its --model built, so a classifier lists its own Trainer row)."""
    rows, user = plan.SCENARIOS, None
    if args.deepspeed or args.model:
        workdir = Path(tempfile.mkdtemp(prefix="zerofix-check-list-"))
        try:
            fsdp = plan.fsdp_setup(args.fsdp_config) if args.fsdp_config and not args.deepspeed else None
            user = (_user(args, args.nproc or 2, workdir) if args.deepspeed else
                    plan.model_setup(args.model, workdir=workdir, gas=args.gas, fsdp_config=fsdp))
            rows = user["rows"]
        except (userconfig.ConfigError, plan.UsageError) as exc:
            parser.error(str(exc))
        finally:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    try:
        chosen = {r.name for r in plan.select(only=_names(args.only), skip=_names(args.skip), quick=args.quick,
                                               rows=rows)}
    except plan.UsageError as exc:
        parser.error(str(exc))
    # what a run would skip says so here too (issue 42: --fp16 --list listed rows it skips on CPU)
    skipped = plan.make([r for r in rows if r.name in chosen], args.nproc or (1 if args.quick else 2), versions(),
                        user).skipped
    for s in rows:
        if s.name in chosen:
            note = f"  [skipped: {skipped[s.name]}]" if s.name in skipped else ("  [quick]" if s.quick else "")
            print(f"{s.name:<28} {s.title}{note}")
    return 0


def _remove(workdir: Path, args) -> None:
    if not args.workdir:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def _names(text):
    return [n.strip() for n in text.split(",") if n.strip()] if text else None
