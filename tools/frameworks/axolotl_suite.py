"""axolotl's own command line, as its users run it, with and without ``ZEROFIX=1`` (issue 60).

    .venvs/axolotl/bin/python tools/frameworks/axolotl_suite.py OUT_DIR [ROW[@LAYOUT] ...] [--jobs 2]

Each row is ``axolotl train config.yml`` (a YAML as in axolotl's examples: full fine-tuning of the tiny local Llama of
``tiny_model.py``, its own ChatML template as ``chat_template: tokenizer_default``, sdpa attention, fp32 set explicitly,
one SGD step, no shuffling). The big batch unpatched on one process is the reference; the accumulated run goes
unpatched and with ``ZEROFIX=1`` (zerofix reaches the run through its ``.pth``, as it reaches a user's). Layouts: one
process (the default: axolotl's default launcher, ``accelerate launch``) GA 4 x 2 against 1 x 8; ``@ddp``, ``@zero2``,
``@zero3``: two processes (axolotl's ``--launcher torchrun -- --nproc_per_node 2``, gloo), GA 4 x 2 per rank against
one process's 1 x 16 on 16 samples; the ZeRO layouts take the keys of axolotl's ``deepspeed_configs/zero2.json`` /
``zero3.json`` (which the package does not ship: written below), plus ``zero_allow_untested_optimizer`` (the rows
train with torch's SGD so that the update is the gradient) and, for zero2.json's optimizer offload,
``zero_force_ds_cpu_optimizer: false`` (DeepSpeed's CPU Adam is not SGD). Each GA run's update is compared with the
reference's (``fw_measure``). Needs the axolotl stack (constraints/axolotl.txt) with zerofix installed in it; nothing
is downloaded (``HF_HUB_OFFLINE``, ``AXOLOTL_DO_NOT_TRACK``).

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

# row -> the YAML's keys besides the common ones; "data" names the dataset file prepare() writes and its "type"
ROWS = {
    "sft": {"data": ("sft", "chat_template")},
    # axolotl's multipack sampler packs the 8 (16) samples into sequences of at most sequence_len tokens; the GA run
    # and the big batch pack the same samples (one step takes them all)
    "packing": {"data": ("sft", "chat_template"), "sample_packing": True, "sample_packing_sequentially": True,
                "sequence_len": 64, "pad_to_sequence_len": True},
    # LoRA on every linear layer, initialised by PiSSA (an exact SVD of the weights: the same adapter in every run,
    # where the default random lora_A differs between a 1 x 8 and a 4 x 2 run at one seed); axolotl's LoRA kernels
    # (on by default) allocate on "cuda": off on this machine
    "lora": {"data": ("sft", "chat_template"), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
             "lora_target_linear": True, "peft_init_lora_weights": "pissa", "lora_mlp_kernel": False,
             "lora_qkv_kernel": False, "lora_o_kernel": False},
    "dpo": {"data": ("pairs", "chat_template.default"), "rl": "dpo", "rl_beta": 0.1},
    "orpo": {"data": ("orpo", "chat_template.argilla"), "rl": "orpo", "orpo_alpha": 0.1},
    "kto": {"data": ("kto", "chatml.argilla"), "rl": "kto", "rl_beta": 0.1, "remove_unused_columns": False},
}
# axolotl's deepspeed_configs/zero2.json and zero3.json ("auto" from the Trainer's arguments; fp16 / bf16 "auto" stay
# off in an fp32 run)
ZERO = {
    "zero2": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True, "overlap_comm": True},
    "zero3": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
              "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True},
}


def prepare(work: Path) -> None:
    """axolotl's dataset files, from tiny_model's samples: pairs (chat_template.default: messages, chosen, rejected),
    orpo (chat_template.argilla: prompt, chosen and rejected conversations), kto (chatml.argilla: instruction,
    completion, label)."""
    def rows(name):
        return [json.loads(line) for line in (work / name).read_text().splitlines()]

    for suffix in ("", "16"):
        with open(work / f"pairs{suffix}.jsonl", "w") as pairs, open(work / f"orpo{suffix}.jsonl", "w") as orpo:
            for r in rows(f"dpo{suffix}.jsonl"):
                user = [m for m in r["messages"] if m["role"] == "user"]
                chosen = [m for m in r["messages"] if m["role"] == "assistant"][0]
                rejected = {"role": "assistant", "content": r["rejected_response"]}
                pairs.write(json.dumps({"messages": user, "chosen": chosen, "rejected": rejected}) + "\n")
                orpo.write(json.dumps({"prompt": user[0]["content"], "chosen": [user[0], chosen],
                                       "rejected": [user[0], rejected]}) + "\n")
    for suffix, source in (("", "kto.jsonl"), ("16", "dpo16.jsonl")):
        samples = rows(source)  # read before kto.jsonl is rewritten in axolotl's fields
        with open(work / f"kto{suffix}.jsonl", "w") as f:
            for i, r in enumerate(samples):
                user = [m for m in r["messages"] if m["role"] == "user"][0]["content"]
                answer = [m for m in r["messages"] if m["role"] == "assistant"][0]["content"]
                good = r["label"] if "label" in r else i % 2 == 0
                if "label" not in r and not good:
                    answer = r["rejected_response"]
                f.write(json.dumps({"instruction": user, "completion": answer, "label": good}) + "\n")


def deepspeed_config(work: Path, layout: str) -> Path:
    config = {"zero_optimization": ZERO[layout], "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    return fw_measure.deepspeed_file(work, layout, config)


def command(work: Path, row: str, out: Path, gas: int, batch: int, layout: str | None = None,
            sixteen: bool = False, lr: float = 1.0) -> list[str]:
    keys = dict(ROWS[row])
    name, kind = keys.pop("data")
    if keys.get("sample_packing"):  # a micro-batch is packed sequences, about two samples each: one a micro-batch
        batch = max(1, batch // 2)  # (the big batch: 4 or 8), so that both runs take the same packs in one step
    data = work / f"{name}{'16' if sixteen else ''}.jsonl"
    dataset = {"path": str(data), "ds_type": "json", "type": kind}
    if kind == "chat_template":
        dataset["field_messages"] = "messages"
    config = {"base_model": str(work / "model"), "tokenizer_type": "AutoTokenizer", "datasets": [dataset],
              "chat_template": "tokenizer_default", "dataset_prepared_path": str(out.parent / f"{out.name}-prepared"),
              "val_set_size": 0, "output_dir": str(out), "sequence_len": 512, "micro_batch_size": batch,
              "gradient_accumulation_steps": gas, "max_steps": 1, "optimizer": "sgd", "learning_rate": lr,
              "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 0.0,
              "bf16": False, "fp16": False, "tf32": False, "sdp_attention": True, "seed": 0,
              "shuffle_merged_datasets": False, "save_steps": 1, "save_only_model": True,
              "dataloader_num_workers": 0, "dataset_processes": 1, "use_wandb": False, **keys}
    if layout in ZERO:
        config["deepspeed"] = str(deepspeed_config(work, layout))
    path = out.with_suffix(".yaml")
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))  # JSON is YAML
    cli = [str(Path(sys.executable).with_name("axolotl")), "train", str(path)]
    if layout:  # axolotl's torchrun launcher, two processes on this machine's CPU
        cli += ["--launcher", "torchrun", "--", "--nproc_per_node", "2", "--master_port", str(fw_measure.free_port())]
    return cli


FRAMEWORK = fw_measure.Framework(
    name="axolotl", rows=tuple(ROWS), judged=frozenset(ROWS) - {"kto"}, command=command,
    two_process_env=lambda: {},  # the layout's launcher is on the command line
    weights="checkpoint-1/*.safetensors", adapters=frozenset({"lora"}),
    prepare=prepare, base_env={"HF_HUB_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1"})

if __name__ == "__main__":
    sys.exit(FRAMEWORK.main())
