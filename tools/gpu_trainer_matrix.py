"""The GPU tier's table: the Trainer x {no engine, FSDP1, FSDP2, ZeRO-2, ZeRO-3} x {bf16, fp16} x {classifier,
causal LM, MoE}, unpatched and patched, each against the float64 single-process reference (issue 39, item 4).

    python tools/gpu_trainer_matrix.py [--nproc N] [--jobs J] [--engines none,fsdp2] [--dtypes bf16] [--json FILE]

Needs CUDA (exits 2 without it); DeepSpeed rows need deepspeed installed. One scenario run per engine and dtype
(``zerofix.check.scenarios.trainer_gas --cuda``), GAS=4 x batch 2, one SGD step. Prints one row per cell:
the update / reference ratio unpatched and patched, and the verdict (fixed, unchanged-right, harmed, still
wrong). A row whose weights did not train on the GPU is an error (a Trainer without a visible GPU falls back to
the CPU silently). tests/test_gpu.py runs it and fails on any row that is not right patched. ``--jobs``: that many
engine x dtype runs at once (one GPU holds dozens of these tiny runs).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import dataclasses
import tempfile
import threading
from pathlib import Path

ENGINES = {"none": {}, "fsdp1": {"fsdp": 1}, "fsdp2": {"fsdp": 2}, "zero2": {"zero_stage": 2},
           "zero3": {"zero_stage": 3}}
CELLS = [{"name": "cls", "model": "seq-cls-llama", "gas": 4, "lr": 2.0, "head": True},
         {"name": "lm", "model": "causal-lm", "gas": 4, "lr": 5.0},
         {"name": "moe", "model": "moe", "gas": 4, "lr": 2.0}]
# Issue 51's rows on the GPU (--cells issue51): the identities of a division, a loss that says it is per window, the
# hand fix, a never-handed head whose handed step runs again (fused-mean), one whose inline mean is proven from its
# logits and weighed (inline-mean, issue 59); each against its float64 reference
ISSUE51_CELLS = ([{"name": r, "model": "causal-lm", "loss": r, "gas": 4, "lr": 5.0}
                  for r in ("sum-from-zero", "where-positive", "plus-eps", "steps-divided-mean", "times-steps")]
                 + [{"name": "nokw-logged-count", "model": "nokw-llama", "loss": "logged-count", "gas": 4, "lr": 5.0,
                     "loss_modes": "batch-mean"},
                    {"name": "fused-mean", "model": "fused-mean-llama", "gas": 4, "lr": 5.0},
                    {"name": "inline-mean", "model": "inline-mean-llama", "gas": 4, "lr": 5.0}])
# Issue 58's rows (--cells issue58): a value equal to GAS is a coincidence: upstream's update, bitwise, right or not
# (the mean / GAS through a compute_loss_func, a loss weight of GAS, four mean terms over 4); a double division, said
ISSUE58_CELLS = [{"name": r, "model": "causal-lm", "loss": r, "gas": 4, "lr": 5.0}
                 for r in ("func-steps-divided-mean", "func-weighted-sum", "four-term-mean", "func-steps-divided-sum")]
# Issue 59's rows (--cells issue59): the heads the Trainer never hands the count: the count handed on to the loss
# function (own-mean-llama), an inline mean proven from the logits and weighed (inline-mean-llama), one with no logits to
# prove it from (fused-mean-llama: upstream's mean of means, its reference)
ISSUE59_CELLS = [{"name": k, "model": k, "gas": 4, "lr": 5.0}
                 for k in ("own-mean-llama", "inline-mean-llama", "fused-mean-llama")]
CELL_SETS = {"default": CELLS, "issue51": ISSUE51_CELLS, "issue58": ISSUE58_CELLS, "issue59": ISSUE59_CELLS}
# relative error of the update against float64; fp32 is no GPU case of its own: it is what a CPU run of this table
# can train (transformers refuses bf16/fp16 without a GPU), so tests/test_gpu_tier_cpu.py asserts the device check
TOLERANCE = {"bf16": 0.03, "fp16": 0.01, "fp32": 1e-4}
# A bf16 router against float64 (top-2 of 4 experts, softmax in bf16): 0.005 - 0.075 patched on an H100, 0.04 on CPU,
# where the bug is >= 0.29 away; its fp32 rows hold the same cells to 1e-4.
HEAD_TOLERANCE = {("moe", "bf16"): 0.1}


# The runs go at once (``--jobs``), each on its own processes; reading their results (transformers' lazy imports, the
# float64 reference) happens in this process, one run at a time: both are shared state.
_READING = threading.Lock()


def _one_at_a_time(interpret):
    def locked(*args):
        with _READING:
            return interpret(*args)

    return locked


def short(text: str) -> str:
    """An error's cause: the last exception line a rank printed (torchrun's own report follows it), else the text's
    start."""
    import re

    causes = re.findall(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$", text, flags=re.M)
    causes = [c for c in causes if not c.startswith(("ChildFailedError", "torch.distributed.elastic"))]
    return (causes[-1] if causes else text)[:600]


def ds_config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16", "loss_scale": 1.0}}


def verdict(unpatched: float, patched: float, right_unpatched: bool, right_patched: bool,
            skipped=(False, False)) -> str:
    if skipped[1]:
        return "no update: the fp16 step was skipped" + (" (unpatched too)" if skipped[0] else "")
    if right_patched:
        return "right (unchanged)" if right_unpatched else "fixed"
    return "HARMED" if right_unpatched else "STILL WRONG"


def one_run(engine: str, dtype: str, nproc: int, cuda: bool = True, cells=None) -> list[dict]:
    """The rows of one engine x dtype run (every head in one Trainer session). ``cuda=False``: the same run on the
    CPU, and every row must have trained there (tests/test_gpu_tier_cpu.py: this code's CPU test). ``cells``: a list of
    CELL_SETS (default: CELLS)."""
    cell_set = CELLS if cells is None else cells
    from zerofix.check import builders, runner

    from zerofix.check.host import env as host_env

    host_env.USE_CUDA = cuda  # the ranks see this machine's GPU (scenario_env hides it everywhere else)
    options = ENGINES[engine]
    cells = [{**c, dtype: True} if dtype != "fp32" else dict(c) for c in cell_set]
    request = builders.trainer_request(
        cells, nproc=nproc, zero_stage=options.get("zero_stage"), fsdp=options.get("fsdp"),
        ds_config=ds_config(options["zero_stage"], dtype) if "zero_stage" in options else None,
        extra_args=("--cuda",) if cuda else (), name=f"gpu-{engine}-{dtype}")
    request = dataclasses.replace(request, interpret=_one_at_a_time(request.interpret))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # on the CPU its ranks are forked after one import, as the check's are (CUDA does not survive a fork)
            results = runner.alone(request, Path(tmp), fork=not cuda)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run says why
            return [{"engine": engine, "dtype": dtype, "error": short(f"{type(exc).__name__}: {exc}")}]
    out = []
    for cell in cell_set:
        result = results[cell["name"]]
        if "error" in result or "patched" not in result:
            out.append({"engine": engine, "dtype": dtype, "head": cell["name"], "error": short(str(result))})
            continue
        bug, fixed = result["unpatched"], result["patched"]
        devices = set(bug.get("device", [])) | set(fixed.get("device", []))
        want = "cuda" if cuda else "cpu"
        if not devices or not all(str(d).startswith(want) for d in devices):
            out.append({"engine": engine, "dtype": dtype, "head": cell["name"],
                        "error": f"trained on {sorted(map(str, devices))}, not the {'GPU' if cuda else 'CPU'}"})
            continue
        bound = HEAD_TOLERANCE.get((cell["name"], dtype), TOLERANCE[dtype])
        right = [r["rel_err"] < bound for r in (bug, fixed)]
        skipped = [any(r.get("step_skipped") or ()) for r in (bug, fixed)]
        out.append({"engine": engine, "dtype": dtype, "head": cell["name"], "unpatched": bug["ratio"],
                    "patched": fixed["ratio"], "unpatched_rel_err": bug["rel_err"],
                    "patched_rel_err": fixed["rel_err"], "bitwise_as_unpatched": fixed.get("bitwise_as_unpatched"),
                    "engine_seen": fixed.get("engine"), "device": sorted(devices),
                    "step_skipped": skipped, "verdict": verdict(bug["ratio"], fixed["ratio"], *right, skipped)})
    return out


def rows(nproc: int = 1, engines=tuple(ENGINES), dtypes=("bf16", "fp16"), jobs: int = 1, on_rows=None,
         cells=None) -> list[dict]:
    """Every engine x dtype run's rows; ``on_rows(rows so far, the run's rows)`` after each run (a caller with a time limit keeps
    what finished)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    todo, out = [], []
    for engine in engines:
        if "zero_stage" in ENGINES[engine] and importlib.util.find_spec("deepspeed") is None:
            out.append({"engine": engine, "skipped": "deepspeed is not installed"})
            continue
        todo += [(engine, dtype) for dtype in dtypes]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # each run is its own processes
        for future in as_completed([pool.submit(one_run, *job, nproc, True, cells) for job in todo]):
            new = future.result()
            out += new
            if on_rows:
                on_rows(out, new)
    order = {e: i for i, e in enumerate(ENGINES)}
    return sorted(out, key=lambda r: (order[r["engine"]], r.get("dtype", ""), r.get("head", "")))


def table(results: list[dict]) -> str:
    lines = ["| engine | dtype | head | unpatched | patched | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        if "verdict" in r:
            lines.append(f"| {r['engine']} | {r['dtype']} | {r['head']} | {r['unpatched']:.4f} | {r['patched']:.4f} "
                         f"| {r['verdict']} |")
        else:
            lines.append(f"| {r['engine']} | {r.get('dtype', '-')} | {r.get('head', '-')} | - | - "
                         f"| {r.get('error') or r['skipped']} |")
    return "\n".join(lines)


def installed(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="engine x dtype runs at once")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--cells", choices=tuple(CELL_SETS), default="default", help="which cells each run trains")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    engines, dtypes = args.engines.split(","), args.dtypes.split(",")
    if unknown := [e for e in engines if e not in ENGINES] + [d for d in dtypes if d not in TOLERANCE]:
        p.error(f"unknown {', '.join(unknown)}: engines are {', '.join(ENGINES)}; dtypes {', '.join(TOLERANCE)}")
    import torch

    if not torch.cuda.is_available():
        print("gpu_trainer_matrix: no CUDA device here; the GPU tier runs only on a GPU machine", file=sys.stderr)
        return 2
    versions = {"device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "processes": args.nproc,
                **{d: installed(d) for d in ("torch", "transformers", "accelerate", "deepspeed")}}
    print(", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    def so_far(done, new):
        print("\n".join(table(new).splitlines()[2:]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"versions": versions, "rows": done, "complete": False}, indent=1))

    results = rows(args.nproc, engines, dtypes, args.jobs, on_rows=so_far, cells=CELL_SETS[args.cells])
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "rows": results, "complete": True}, indent=1))
    bad = [r for r in results if "error" in r or r.get("verdict", "right").startswith(("HARMED", "STILL"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
