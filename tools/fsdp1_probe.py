"""Does the Trainer itself stop on FSDP1, or only zerofix's scenario? A plain Trainer run, no zerofix, no callbacks.

    torchrun --nproc_per_node 1 tools/fsdp1_probe.py [--bf16] [--snapshot]

A tiny Llama causal LM, FSDP1 full shard through TrainingArguments (the scenario's settings), GAS 4, one step, on the
GPU. ``--snapshot`` also reads the full weights in ``on_train_begin`` (what the scenario's Snapshots callback does,
through zerofix.check.fsdp_cpu.full_state). Prints ``FSDP1 TRAINED`` or the exception. Measured on a GPU only: FSDP1
does not run on CPU (torch's own device checks).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--snapshot", action="store_true")
    args = p.parse_args()
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zerofix.check import models

    model = models.build_model("causal-lm", 0)
    dataset = models.IndexedDataset(8, 0, models.task_of("causal-lm"))

    class Snapshot(TrainerCallback):
        def on_train_begin(self, *a, **k):
            from zerofix.check.fsdp_cpu import full_state

            full_state(trainer.model, trainer.model_wrapped)

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1,
            learning_rate=1.0, optim="sgd", report_to="none", save_strategy="no", logging_strategy="no",
            bf16=args.bf16, remove_unused_columns=False, disable_tqdm=True, fsdp="full_shard",
            fsdp_config={"version": 1})  # as the scenario sets it (zerofix.check.scenarios.trainer_gas)
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=models.stack,
                          callbacks=[Snapshot()] if args.snapshot else [])
        try:
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - the answer is the exception
            print(f"FSDP1 STOPPED: {type(exc).__name__}: {exc}", flush=True)
            raise
    print(f"FSDP1 TRAINED ({'bf16' if args.bf16 else 'fp32'}, snapshot={args.snapshot}, "
          f"{type(trainer.model_wrapped).__name__}, {torch.cuda.get_device_name(0)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
