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

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fw_measure  # noqa: E402
import tiny_vlm  # noqa: E402

# row -> (swift subcommand arguments, dataset file)
ROWS = {
    "sft": (["sft"], "sft.jsonl"),
    # ms-swift #10084 (a short last window said to get half the gradient): 10 samples, one epoch, GA 4 x 2 gives a window
    # of 4 micro-batches, then one of 1; the big batch 8 x 1 takes the same two steps (8 samples, then 2)
    "sft-short": (["sft"], "sft10.jsonl"),
    "sft-dft": (["sft", "--enable_dft_loss", "true"], "sft.jsonl"),  # ms-swift's DFT loss (arXiv 2508.05629)
    "sft-react": (["sft", "--loss_scale", "react"], "sft.jsonl"),  # the ReAct loss scale (weights per span)
    "dpo": (["rlhf", "--rlhf_type", "dpo"], "dpo.jsonl"),
    "dpo-rpo": (["rlhf", "--rlhf_type", "dpo", "--rpo_alpha", "1"], "dpo.jsonl"),
    "orpo": (["rlhf", "--rlhf_type", "orpo"], "dpo.jsonl"),
    "cpo": (["rlhf", "--rlhf_type", "cpo"], "dpo.jsonl"),
    "simpo": (["rlhf", "--rlhf_type", "simpo"], "dpo.jsonl"),
    "rm": (["rlhf", "--rlhf_type", "rm"], "dpo.jsonl"),
    "kto": (["rlhf", "--rlhf_type", "kto"], "kto.jsonl"),
    # GRPO generates with the Trainer's model (no vLLM here): 2 completions of up to 12 tokens per prompt, rewarded by
    # their length (a plugin, as ms-swift's users add their own rewards); its default steps_per_generation = GA, so the
    # accumulated run and the big batch sample the same 8 completions from the same seed (measured: 1.8e-7)
    "grpo": (["rlhf", "--rlhf_type", "grpo", "--external_plugins", "{work}/length_reward.py", "--reward_funcs", "length",
              "--num_generations", "2", "--max_completion_length", "12", "--use_vllm", "false", "--temperature", "1.0"],
             "prompts.jsonl"),
    # the same with loss_type bnpo (issue 60): normalised by each micro-batch's completion tokens, by definition
    "grpo-bnpo": (["rlhf", "--rlhf_type", "grpo", "--loss_type", "bnpo", "--external_plugins", "{work}/length_reward.py",
                   "--reward_funcs", "length", "--num_generations", "2", "--max_completion_length", "12",
                   "--use_vllm", "false", "--temperature", "1.0"], "prompts.jsonl"),
    # vision-language models with images (issue 67, item 4): tiny_vlm's Qwen2-VL / Qwen2.5-VL and its SFT data (ms-swift's
    # own format: `<image>` in the user's turn, the picture under "images"), ms-swift's template for the family
    "vlm": (["sft", "--model_type", "qwen2_vl", "--template", "qwen2_vl"], "vlm.jsonl"),
    "vlm25": (["sft", "--model_type", "qwen2_5_vl", "--template", "qwen2_5_vl"], "vlm.jsonl"),
}
# row -> the folder of its model (tiny_vlm's family), where not tiny_model's Llama
FAMILY = {"vlm": "qwen2_vl", "vlm25": "qwen2_5_vl"}
LENGTH_REWARD = '''from swift.rewards.orm import ORM, orms


class Length(ORM):
    """A reward that differs between completions: their length in characters, scaled."""

    def __call__(self, completions, **kwargs):
        return [len(c) / 10.0 for c in completions]


orms["length"] = Length
'''


def prepare(work: Path) -> None:
    """GRPO's reward plugin and its prompts (the SFT samples' user turns: 4 prompts x 2 completions make 8); the
    vision-language rows' models and data."""
    (work / "length_reward.py").write_text(LENGTH_REWARD)
    tiny_vlm.build(work, tuple(FAMILY.values()), qwen_ids=True)  # the ids ms-swift's template expands
    sixteen = (work / "sft16.jsonl").read_text().splitlines()
    (work / "sft10.jsonl").write_text("".join(line + "\n" for line in sixteen[:10]))
    for name, count in (("prompts.jsonl", 4), ("prompts16.jsonl", 8)):
        rows = [json.loads(line) for line in (work / name.replace("prompts", "sft")).read_text().splitlines()]
        (work / name).write_text("".join(json.dumps({"messages": [m for m in r["messages"] if m["role"] == "user"]})
                                         + "\n" for r in rows[:count]))


def deepspeed_config(work: Path, layout: str) -> Path:
    """ms-swift's own config for the layout, with the one key torch's SGD needs under ZeRO."""
    import swift

    config = json.loads((Path(swift.__file__).parent / "config" / f"{layout}.json").read_text())
    config["zero_allow_untested_optimizer"] = True
    path = work / f"{layout}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def command(work: Path, row: str, out: Path, gas: int, batch: int, layout: str | None = None,
            sixteen: bool = False) -> list[str]:
    swift = str(Path(sys.executable).with_name("swift"))
    sub, data = ROWS[row]
    if sixteen:
        data = data.replace(".jsonl", "16.jsonl")
    extra = ["--deepspeed", str(deepspeed_config(work, layout))] if layout in ("zero2", "zero3") else []
    sub = [arg.format(work=work) for arg in sub]
    # one SGD step; a short-window row: one epoch (two steps), its weights after both
    steps = ["--max_steps", "-1", "--num_train_epochs", "1", "--save_steps", "2"] if row == "sft-short" else \
        ["--max_steps", "1", "--save_steps", "1"]
    model = [] if row in FAMILY else ["--model_type", "llama", "--template", "chatml"]  # a VLM row names its own
    return [swift, *sub, *extra, "--model", str(work / FAMILY.get(row, "model")), *model,
            "--dataset", str(work / data), "--tuner_type", "full", "--torch_dtype", "float32", "--fp16", "false",
            "--bf16", "false", "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(gas),
            *steps, "--learning_rate", "1", "--optim", "sgd", "--lr_scheduler_type", "constant",
            "--warmup_ratio", "0", "--weight_decay", "0", "--max_grad_norm", "0", "--output_dir", str(out),
            "--save_strategy", "steps", "--save_only_model", "true", "--logging_steps", "1",
            "--use_cpu", "true", "--split_dataset_ratio", "0", "--dataloader_num_workers", "0", "--report_to", "none",
            "--seed", "0", "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false"]


FRAMEWORK = fw_measure.Framework(
    name="swift", rows=tuple(ROWS), judged=frozenset(ROWS) - {"kto"}, command=command,
    two_process_env=lambda: {"NPROC_PER_NODE": "2"},  # ms-swift launches torchrun itself
    weights="*/checkpoint-*/model.safetensors", prepare=prepare,  # one checkpoint a run: its last step's
    model_of=lambda work, row: work / FAMILY.get(row, "model"),
    base_env={"MODELSCOPE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})

if __name__ == "__main__":
    sys.exit(FRAMEWORK.main())
