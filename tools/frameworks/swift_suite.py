"""ms-swift's own command lines, as its users run them, with and without ``ZEROFIX=1`` (issue 53).

    .venvs/swift/bin/python tools/frameworks/swift_suite.py OUT_DIR [ROW[@LAYOUT] ...] [--jobs 2]

For each row (``swift sft`` or ``swift rlhf --rlhf_type ...`` on a tiny local Llama, fp32, one SGD step): the big
batch unpatched on one process is the reference; the accumulated run goes unpatched and with ``ZEROFIX=1`` (zerofix
reaches the run through its ``.pth``, as it reaches a user's). Layouts: one process (the default) GA 4 x 2 against
1 x 8; ``@ddp``, ``@zero2``, ``@zero3``: two processes (``NPROC_PER_NODE=2``, ms-swift's own torchrun launch, gloo),
GA 4 x 2 per rank against one process's 1 x 16 on 16 samples; the ZeRO layouts take ms-swift's own ``zero2.json`` /
``zero3.json`` with ``zero_allow_untested_optimizer`` added (the rows use torch's SGD, so the update is the gradient).
Every row passes ``--fp16 false --bf16 false``: ms-swift sets ``fp16=True`` by itself (inert on CPU without DeepSpeed;
with it, the config's "auto" turns fp16 on, which DeepSpeed's CPU accelerator refuses). Each GA run's update is compared with the reference's:
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
LAYOUTS = ("ddp", "zero2", "zero3")  # two processes; the default layout is one process


def split(name: str) -> tuple[str, str | None]:
    """``sft@zero2`` -> ("sft", "zero2"); ``sft`` -> ("sft", None)."""
    row, _, layout = name.partition("@")
    if row not in ROWS or (layout and layout not in LAYOUTS):
        raise SystemExit(f"unknown row {name!r}: rows {sorted(ROWS)}, layouts @{', @'.join(LAYOUTS)}")
    return row, layout or None


def deepspeed_config(work: Path, layout: str) -> Path:
    """ms-swift's own config for the layout, with the one key torch's SGD needs under ZeRO."""
    import swift

    config = json.loads((Path(swift.__file__).parent / "config" / f"{layout}.json").read_text())
    config["zero_allow_untested_optimizer"] = True
    path = work / f"{layout}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def command(swift: str, work: Path, row: str, out: Path, gas: int, batch: int, layout: str | None = None,
            sixteen: bool = False) -> list[str]:
    sub, data = ROWS[row]
    if sixteen:
        data = data.replace(".jsonl", "16.jsonl")
    extra = ["--deepspeed", str(deepspeed_config(work, layout))] if layout in ("zero2", "zero3") else []
    return [swift, *sub, *extra, "--model", str(work / "model"), "--model_type", "llama", "--template", "chatml",
            "--dataset", str(work / data), "--tuner_type", "full", "--torch_dtype", "float32", "--fp16", "false", "--bf16", "false",
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(gas), "--max_steps", "1",
            "--learning_rate", "1", "--optim", "sgd", "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
            "--weight_decay", "0", "--max_grad_norm", "0", "--output_dir", str(out), "--save_strategy", "steps",
            "--save_steps", "1", "--save_only_model", "true", "--logging_steps", "1", "--use_cpu", "true",
            "--split_dataset_ratio", "0", "--dataloader_num_workers", "0", "--report_to", "none", "--seed", "0",
            "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false"]


def run(swift: str, work: Path, name: str, variant: str, reuse: bool = False) -> dict:
    """One run of row ``name`` (``row[@layout]``): ``big`` (the reference: one process, the whole batch at once),
    ``plain`` or ``zerofix`` (accumulated, in the layout)."""
    row, layout = split(name)
    two = layout is not None
    if variant == "big":
        gas, batch = 1, 16 if two else 8
    else:
        gas, batch = 4, 2
    where = reference_name(name) if variant == "big" else name  # one reference for a row's 2-process layouts
    out = work / "runs" / where / variant
    found = glob.glob(str(out / "*" / "checkpoint-1" / "model.safetensors"))
    log_file = work / "runs" / where / f"{variant}.log"
    if reuse and found and log_file.exists():
        log = log_file.read_text()
        return {"row": name, "variant": variant, "rc": 0, "weights": found[0],
                "zerofix_lines": zerofix_lines(log)}
    env = {**os.environ, "MODELSCOPE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("ZEROFIX", None)
    env.pop("NPROC_PER_NODE", None)
    if variant == "zerofix":
        env["ZEROFIX"] = "1"
    if two and variant != "big":
        env["NPROC_PER_NODE"], env["MASTER_PORT"] = "2", str(free_port())
    cmd = command(swift, work, row, out, gas, batch, layout if variant != "big" else None, sixteen=two)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    log_file.write_text(log)
    found = glob.glob(str(out / "*" / "checkpoint-1" / "model.safetensors"))
    return {"row": name, "variant": variant, "rc": done.returncode, "weights": found[0] if found else None,
            "zerofix_lines": zerofix_lines(log)}


def reference_name(name: str) -> str:
    """Where row ``name``'s reference runs: its own folder on one process; ``row@16`` for every 2-process layout."""
    row, layout = split(name)
    return f"{row}@16" if layout else name


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    p.add_argument("--write-docs", action="store_true", help="write the measured rows into docs/frameworks.md's table")
    args = p.parse_args(argv)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and (work / "model").exists()):
        tiny_model.build(work)
    swift = str(Path(sys.executable).with_name("swift"))
    for name in args.rows:
        for where in (name, reference_name(name)):
            (work / "runs" / where).mkdir(parents=True, exist_ok=True)
    references = {reference_name(name): name for name in args.rows}  # each reference runs once
    jobs = [(name, "big") for name in references.values()]
    jobs += [(row, v) for row in args.rows for v in ("plain", "zerofix")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run(swift, work, *job, reuse=args.reuse), jobs))
    by = {(r["row"], r["variant"]): r for r in runs}
    results = []
    for row in args.rows:
        big = by[(references[reference_name(row)], "big")]
        entry = {"row": row, "judged": split(row)[0] in JUDGED}
        for variant in ("plain", "zerofix"):
            ran = by[(row, variant)]
            if not (ran["weights"] and big["weights"]):
                entry[variant] = {"error": f"rc {ran['rc']} / {big['rc']}: see runs/{row}/{variant}.log"}
                continue
            entry[variant] = compare(work, ran["weights"], big["weights"])
        entry["zerofix_lines"] = by[(row, "zerofix")]["zerofix_lines"]
        results.append(entry)
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    print(HEADER)
    for r in results:
        print(table_row(r))
    if args.write_docs:
        write_docs(results, DOCS)
        print(f"written into {DOCS}")
    return 0


# docs/frameworks.md's ms-swift table, generated: write_docs replaces the rows it measured and keeps the others
DOCS = HERE.parent.parent / "docs" / "frameworks.md"
BEGIN, END = "<!-- swift-table: generated by tools/frameworks/swift_suite.py --write-docs -->", "<!-- /swift-table -->"
HEADER = "| run | unpatched | `ZEROFIX=1` | zerofix said |\n|---|---|---|---|"
SAID = (("read as already per accumulation window", "loss read as per window"),
        ("averages a term over its own micro-batch", "WARNING: a micro-batch mean term"))


def said(result: dict) -> str:
    """What zerofix's console lines said of the row's loss, in a few words."""
    lines = "\n".join(result.get("zerofix_lines", ()))
    return "; ".join(short for marker, short in SAID if marker in lines) or "-"


def table_row(result: dict) -> str:
    return (f"| `{result['row']}` | {cell(result['plain'], result['judged'])} | "
            f"{cell(result['zerofix'], result['judged'])} | {said(result)} |")


def doc_rows(path: Path = DOCS) -> dict[str, str]:
    """The generated table's rows in the docs, by row name."""
    text = path.read_text()
    if BEGIN not in text:
        return {}
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return {line.split("`")[1]: line for line in body.splitlines() if line.startswith("| `")}


def write_docs(results: list[dict], path: Path = DOCS) -> None:
    rows = doc_rows(path)
    rows.update({r["row"]: table_row(r) for r in results})
    order = [f"{row}{suffix}" for suffix in ("", *(f"@{layout}" for layout in LAYOUTS)) for row in ROWS]
    table = "\n".join([HEADER, *(rows[name] for name in order if name in rows)])
    text = path.read_text()
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]
    else:
        raise SystemExit(f"{path} has no {BEGIN} marker")
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
