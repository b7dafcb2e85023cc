"""The GPU tier's table: the Trainer x {no engine, FSDP1, FSDP2, ZeRO-2, ZeRO-3} x {bf16, fp16} x {classifier,
causal LM}, unpatched and patched, each against the float64 single-process reference (issue 39, item 4).

    python tools/gpu_trainer_matrix.py [--nproc N] [--json FILE]

Needs CUDA (exits 2 without it); DeepSpeed rows need deepspeed installed. One scenario run per engine and dtype
(``zerofix.check.scenarios.trainer_gas --cuda``), GAS=4 x batch 2, one SGD step. Prints one row per cell:
the update / reference ratio unpatched and patched, and the verdict (fixed, unchanged-right, harmed, still
wrong). tests/test_gpu.py runs it and fails on any row that is not right patched.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ENGINES = {"none": {}, "fsdp1": {"fsdp": 1}, "fsdp2": {"fsdp": 2}, "zero2": {"zero_stage": 2},
           "zero3": {"zero_stage": 3}}
CELLS = [{"name": "cls", "model": "seq-cls-llama", "gas": 4, "lr": 2.0, "head": True},
         {"name": "lm", "model": "causal-lm", "gas": 4, "lr": 5.0}]
TOLERANCE = {"bf16": 0.03, "fp16": 0.01}  # relative error of a half-precision update against float64


def ds_config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16", "loss_scale": 1.0}}


def verdict(unpatched: float, patched: float, right_unpatched: bool, right_patched: bool) -> str:
    if right_patched:
        return "right (unchanged)" if right_unpatched else "fixed"
    return "HARMED" if right_unpatched else "STILL WRONG"


def rows(nproc: int = 1, engines=tuple(ENGINES), dtypes=("bf16", "fp16")) -> list[dict]:
    from zerofix.check import parity, runner

    out = []
    for engine in engines:
        options = ENGINES[engine]
        if "zero_stage" in options and importlib.util.find_spec("deepspeed") is None:
            out.append({"engine": engine, "skipped": "deepspeed is not installed"})
            continue
        for dtype in dtypes:
            cells = [{**c, dtype: True} for c in CELLS]
            request = parity.trainer_request(
                cells, nproc=nproc, zero_stage=options.get("zero_stage"), fsdp=options.get("fsdp"),
                ds_config=ds_config(options["zero_stage"], dtype) if "zero_stage" in options else None,
                extra_args=("--cuda",), name=f"gpu-{engine}-{dtype}")
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    results = runner.alone(request, Path(tmp))
                except Exception as exc:  # noqa: BLE001 - a row that cannot run says why
                    out.append({"engine": engine, "dtype": dtype, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
            for cell in CELLS:
                bug, fixed = results[cell["name"]]["unpatched"], results[cell["name"]]["patched"]
                right = [r["rel_err"] < TOLERANCE[dtype] for r in (bug, fixed)]
                out.append({"engine": engine, "dtype": dtype, "head": cell["name"], "unpatched": bug["ratio"],
                            "patched": fixed["ratio"], "patched_rel_err": fixed["rel_err"],
                            "bitwise_as_unpatched": fixed.get("bitwise_as_unpatched"),
                            "engine_seen": fixed.get("engine"),
                            "verdict": verdict(bug["ratio"], fixed["ratio"], *right)})
    return out


def table(results: list[dict]) -> str:
    lines = ["| engine | dtype | head | unpatched | patched | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        if "verdict" in r:
            lines.append(f"| {r['engine']} | {r['dtype']} | {r['head']} | {r['unpatched']:.4f} | {r['patched']:.4f} "
                         f"| {r['verdict']} |")
        else:
            lines.append(f"| {r['engine']} | {r.get('dtype', '-')} | - | - | - | {r.get('error') or r['skipped']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_trainer_matrix: no CUDA device here; the GPU tier runs only on a GPU machine", file=sys.stderr)
        return 2
    import transformers

    results = rows(args.nproc)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, processes {args.nproc}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if "error" in r or r.get("verdict", "right").startswith(("HARMED", "STILL"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
