"""LLaMA-Factory's own command line, as its users run it, with and without ``ZEROFIX=1`` (issue 53).

    .venvs/llamafactory/bin/python tools/frameworks/llamafactory_suite.py OUT_DIR [ROW[@LAYOUT] ...] [--jobs 2]

Each row is ``llamafactory-cli train config.yaml`` (a YAML as in LLaMA-Factory's examples: full fine-tuning of the tiny
local Llama of ``tiny_model.py``, its ``chatml`` template, fp32, one SGD step, ``disable_shuffling``). The big batch
unpatched on one process is the reference; the accumulated run goes unpatched and with ``ZEROFIX=1`` (zerofix reaches
the run through its ``.pth``, as it reaches a user's). Layouts: one process (the default) GA 4 x 2 against 1 x 8;
``@ddp``, ``@zero2``, ``@zero3``: two processes (``FORCE_TORCHRUN=1 NPROC_PER_NODE=2``, LLaMA-Factory's own torchrun
launch, gloo), GA 4 x 2 per rank against one process's 1 x 16 on 16 samples; the ZeRO layouts take the DeepSpeed
configs of LLaMA-Factory's ``examples/deepspeed`` (``ds_z2_config.json`` / ``ds_z3_config.json``, which the package does
not ship: their keys are written below). Each GA run's update is compared with the reference's: ``ratio``, ``cosine``,
``rel`` (max |A - R| / max |R|; right when below 1e-4). Writes OUT_DIR/results.jsonl and prints a Markdown table
(docs/frameworks.md holds the measured one). Needs the llamafactory stack (constraints/llamafactory.txt) with zerofix
installed in it; nothing is downloaded (HF_HUB_OFFLINE).

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

# row -> (the YAML's keys besides the common ones); dataset names are dataset_info.json's below
ROWS = {
    "sft": {"stage": "sft", "dataset": "sft"},
    "dft": {"stage": "sft", "dataset": "sft", "use_dft_loss": True},
    "asft": {"stage": "sft", "dataset": "sft", "use_asft_loss": True, "asft_alpha": 0.1},
    # the 16 samples (about 30 to 80 tokens each) packed into sequences of at most 96 tokens: 9 of them (measured), the
    # first 8 train in both runs
    "packing": {"stage": "sft", "dataset": "sft16", "packing": True, "cutoff_len": 96},
    "dpo": {"stage": "dpo", "dataset": "pairs", "pref_loss": "sigmoid", "pref_beta": 0.1},
    "dpo-ftx": {"stage": "dpo", "dataset": "pairs", "pref_loss": "sigmoid", "pref_beta": 0.1, "pref_ftx": 1.0},
    "orpo": {"stage": "dpo", "dataset": "pairs", "pref_loss": "orpo", "pref_beta": 0.1},
    "simpo": {"stage": "dpo", "dataset": "pairs", "pref_loss": "simpo", "pref_beta": 0.1},
    "kto": {"stage": "kto", "dataset": "kto", "pref_beta": 0.1},
    "rm": {"stage": "rm", "dataset": "pairs"},
    # vision-language models with images (issue 67: with a processor, LLaMA-Factory's SFT trainer sets
    # model_accepts_loss_kwargs = False), tiny_vlm's models and data; "family" names the model's folder
    "vlm": {"stage": "sft", "dataset": "vlm", "family": "qwen2_vl", "template": "qwen2_vl"},
    # LoRA on every linear layer, initialised by PiSSA with an exact SVD (pissa_iter -1): the same adapter in every run
    "vlm-lora": {"stage": "sft", "dataset": "vlm", "family": "qwen2_vl", "template": "qwen2_vl",
                 "finetuning_type": "lora", "lora_target": "all", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                 "pissa_init": True, "pissa_iter": -1},
    "vlm25": {"stage": "sft", "dataset": "vlm", "family": "qwen2_5_vl", "template": "qwen2_vl"},
    # one own-mean head of the count survey: Qwen3-VL, whose class says accepts_loss_kwargs = False and whose forward
    # calls its loss function without the count on transformers 5.6
    "vlm3": {"stage": "sft", "dataset": "vlm", "family": "qwen3_vl", "template": "qwen3_vl_nothink"},
}
VLM_ROWS = frozenset(row for row, keys in ROWS.items() if "family" in keys)
SHAREGPT_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
# LLaMA-Factory v0.9.5's examples/deepspeed/ds_z{2,3}_config.json: the keys that matter on this machine ("auto" from
# the Trainer's arguments; fp16 / bf16 "auto" stay off in an fp32 run)
ZERO = {
    "zero2": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
              "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
              "round_robin_gradients": True},
    "zero3": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
              "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def prepare(work: Path) -> None:
    """LLaMA-Factory's dataset files (sharegpt) and their dataset_info.json, from tiny_model's samples."""
    def rows(name):
        return [json.loads(line) for line in (work / name).read_text().splitlines()]

    for suffix in ("", "16"):
        with open(work / f"pairs{suffix}.jsonl", "w") as f:
            for r in rows(f"dpo{suffix}.jsonl"):
                user = [m for m in r["messages"] if m["role"] == "user"]
                chosen = [m for m in r["messages"] if m["role"] == "assistant"][0]
                f.write(json.dumps({"messages": user, "chosen": chosen,
                                    "rejected": {"role": "assistant", "content": r["rejected_response"]}}) + "\n")
    info = {}
    for suffix in ("", "16"):
        info[f"sft{suffix}"] = {"file_name": f"sft{suffix}.jsonl", "formatting": "sharegpt",
                                "columns": {"messages": "messages"}, "tags": SHAREGPT_TAGS}
        info[f"pairs{suffix}"] = {"file_name": f"pairs{suffix}.jsonl", "formatting": "sharegpt", "ranking": True,
                                  "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected"},
                                  "tags": SHAREGPT_TAGS}
    info["kto"] = {"file_name": "kto.jsonl", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "kto_tag": "label"}, "tags": SHAREGPT_TAGS}
    info["vlm"] = {"file_name": "vlm.jsonl", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "images": "images"}, "tags": SHAREGPT_TAGS}
    (work / "dataset_info.json").write_text(json.dumps(info, indent=1))
    # the reward model's value head (TRL's, which LLaMA-Factory's stage rm adds) drops 10% of its input unless the
    # model's config says otherwise: random masks drawn in a different order by GA and the big batch
    config = json.loads((work / "model" / "config.json").read_text())
    config["summary_dropout_prob"] = 0.0
    (work / "model" / "config.json").write_text(json.dumps(config, indent=1))
    tiny_vlm.build(work)  # the vision-language rows' models and data (a few seconds)


def deepspeed_config(work: Path, layout: str) -> Path:
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_allow_untested_optimizer": True, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
              "zero_optimization": ZERO[layout]}
    return fw_measure.deepspeed_file(work, layout, config)


def command(work: Path, row: str, out: Path, gas: int, batch: int, layout: str | None = None,
            sixteen: bool = False, lr: float = 1.0) -> list[str]:
    keys = dict(ROWS[row])
    if sixteen and not keys["dataset"].endswith("16"):
        keys["dataset"] += "16"
    model = work / keys.pop("family", "model")
    config = {"model_name_or_path": str(model), "do_train": True, "finetuning_type": "full",
              "dataset_dir": str(work), "template": "chatml", "cutoff_len": 512, "overwrite_cache": True,
              "preprocessing_num_workers": 1, "dataloader_num_workers": 0, "output_dir": str(out),
              "logging_steps": 1, "save_steps": 1, "save_only_model": True, "overwrite_output_dir": True,
              "report_to": "none", "per_device_train_batch_size": batch, "gradient_accumulation_steps": gas,
              "learning_rate": lr, "max_steps": 1, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
              "optim": "sgd", "weight_decay": 0.0, "max_grad_norm": 0.0, "disable_shuffling": True, "seed": 0,
              "bf16": False, "fp16": False, **keys}
    if layout in ZERO:
        config["deepspeed"] = str(deepspeed_config(work, layout))
    path = out.with_suffix(".yaml")
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))  # JSON scalars are YAML
    return [str(Path(sys.executable).with_name("llamafactory-cli")), "train", str(path)]


FRAMEWORK = fw_measure.Framework(
    name="llamafactory", rows=tuple(ROWS), judged=frozenset(ROWS) - {"kto"}, command=command,
    two_process_env=lambda: {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"},  # LLaMA-Factory launches torchrun
    weights="checkpoint-1/*model.safetensors", adapters=frozenset({"vlm-lora"}),  # a LoRA run saves its adapter
    model_of=lambda work, row: work / ROWS[row].get("family", "model"),
    prepare=prepare, base_env={"HF_HUB_OFFLINE": "1"})

if __name__ == "__main__":
    sys.exit(FRAMEWORK.main())
