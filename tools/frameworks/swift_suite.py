"""ms-swift's own command lines, as its users run them, with and without ``ZEROFIX=1`` (issue 53).

    .venvs/swift/bin/python tools/frameworks/swift_suite.py OUT_DIR [ROW ...] [--jobs 2]

For each row (``swift sft`` or ``swift rlhf --rlhf_type ...`` on a tiny local Llama, one process, fp32, one SGD step):
the big batch (GA 1 x 8) unpatched is the reference; GA 4 x 2 runs unpatched and with ``ZEROFIX=1`` (zerofix reaches
the run through its ``.pth``, as it reaches a user's). Each GA run's update is compared with the reference's:
``ratio`` (<A, R> / <R, R>), ``cosine``, ``rel`` (max |A - R| / max |R|; right when below 1e-4). Writes
OUT_DIR/results.jsonl and prints a Markdown table (docs/frameworks.md holds the measured one). Needs the swift stack
(constraints/swift.txt) with zerofix installed in it; nothing is downloaded (MODELSCOPE_OFFLINE, HF_HUB_OFFLINE).

KTO's loss estimates a KL term from the batch's mismatched pairs, so GA 4 x 2 and 1 x 8 differ by design there: its row
is measured, not judged.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_model  # noqa: E402
from fw_measure import cell, comparison  # noqa: E402

# row -> (swift subcommand arguments, dataset file)
ROWS = {
    "sft": (["sft"], "sft.jsonl"),
    "dpo": (["rlhf", "--rlhf_type", "dpo"], "dpo.jsonl"),
    "dpo-rpo": (["rlhf", "--rlhf_type", "dpo", "--rpo_alpha", "1"], "dpo.jsonl"),
    "orpo": (["rlhf", "--rlhf_type", "orpo"], "dpo.jsonl"),
    "cpo": (["rlhf", "--rlhf_type", "cpo"], "dpo.jsonl"),
    "simpo": (["rlhf", "--rlhf_type", "simpo"], "dpo.jsonl"),
    "rm": (["rlhf", "--rlhf_type", "rm"], "dpo.jsonl"),
    "kto": (["rlhf", "--rlhf_type", "kto"], "kto.jsonl"),
}
JUDGED = {row for row in ROWS if row != "kto"}


def command(swift: str, work: Path, row: str, out: Path, gas: int, batch: int) -> list[str]:
    sub, data = ROWS[row]
    return [swift, *sub, "--model", str(work / "model"), "--model_type", "llama", "--template", "chatml",
            "--dataset", str(work / data), "--tuner_type", "full", "--torch_dtype", "float32",
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(gas), "--max_steps", "1",
            "--learning_rate", "1", "--optim", "sgd", "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
            "--weight_decay", "0", "--max_grad_norm", "0", "--output_dir", str(out), "--save_strategy", "steps",
            "--save_steps", "1", "--save_only_model", "true", "--logging_steps", "1", "--use_cpu", "true",
            "--split_dataset_ratio", "0", "--dataloader_num_workers", "0", "--report_to", "none", "--seed", "0",
            "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false"]


def run(swift: str, work: Path, row: str, variant: str, reuse: bool = False) -> dict:
    gas, batch = (1, 8) if variant == "big" else (4, 2)
    out = work / "runs" / row / variant
    found = glob.glob(str(out / "*" / "checkpoint-1" / "model.safetensors"))
    log_file = work / "runs" / row / f"{variant}.log"
    if reuse and found and log_file.exists():
        log = log_file.read_text()
        return {"row": row, "variant": variant, "rc": 0, "weights": found[0],
                "zerofix_lines": zerofix_lines(log)}
    env = {**os.environ, "MODELSCOPE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("ZEROFIX", None)
    if variant == "zerofix":
        env["ZEROFIX"] = "1"
    done = subprocess.run(command(swift, work, row, out, gas, batch), env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    (work / "runs" / row / f"{variant}.log").write_text(log)
    found = glob.glob(str(out / "*" / "checkpoint-1" / "model.safetensors"))
    return {"row": row, "variant": variant, "rc": done.returncode, "weights": found[0] if found else None,
            "zerofix_lines": zerofix_lines(log)}


def zerofix_lines(log: str) -> list[str]:
    """What zerofix said in the run's console (the Trainer log's lines and the zerofix logger's)."""
    return [line for line in log.splitlines() if "zerofix: " in line]


def update(work: Path, weights: str):
    import torch
    from safetensors.torch import load_file

    init, end = load_file(work / "model" / "model.safetensors"), load_file(weights)
    # the parameters both have (a reward model's score head is new: its backbone's update is compared)
    return torch.cat([(end[k].double() - init[k].double()).flatten() for k in sorted(init) if k in end])


def compare(work: Path, measured: str, reference: str) -> dict:
    return comparison(update(work, measured), update(work, reference))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("rows", nargs="*", default=list(ROWS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--reuse", action="store_true", help="compare the runs OUT_DIR already holds, running only the rest")
    args = p.parse_args(argv)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and (work / "model").exists()):
        tiny_model.build(work)
    swift = str(Path(sys.executable).with_name("swift"))
    for row in args.rows:
        (work / "runs" / row).mkdir(parents=True, exist_ok=True)
    jobs = [(row, v) for row in args.rows for v in ("big", "plain", "zerofix")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run(swift, work, *job, reuse=args.reuse), jobs))
    by = {(r["row"], r["variant"]): r for r in runs}
    results = []
    for row in args.rows:
        big = by[(row, "big")]
        entry = {"row": row, "judged": row in JUDGED}
        for variant in ("plain", "zerofix"):
            ran = by[(row, variant)]
            if not (ran["weights"] and big["weights"]):
                entry[variant] = {"error": f"rc {ran['rc']} / {big['rc']}: see runs/{row}/{variant}.log"}
                continue
            entry[variant] = compare(work, ran["weights"], big["weights"])
        entry["zerofix_lines"] = by[(row, "zerofix")]["zerofix_lines"]
        results.append(entry)
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    print("| run | unpatched | `ZEROFIX=1` |\n|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {cell(r['plain'], r['judged'])} | {cell(r['zerofix'], r['judged'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
