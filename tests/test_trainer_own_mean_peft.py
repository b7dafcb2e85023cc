"""Issue 59, item 1: the heads that compute their own token mean, trained through PEFT LoRA, with and without gradient
checkpointing (reentrant and not), as LLaMA-Factory and ms-swift users fine-tune Qwen-VL and Gemma 3.

PEFT's tuner calls the model's ``forward`` directly, so the Trainer entry hooks the PeftModel, whose call carries the
count, and hands the count to the loss function of the model inside it (``trainer_scaling.CountToLoss``); an inline
mean (Gemma 3's) is proven from the logits the PeftModel returns. Real Trainer runs on transformers 5.6 (the
``llamafactory`` stack, PEFT 0.18.1): LoRA (r 4) on the attention projections, SGD, fp32, GAS 4 x batch 2 against the
same 8 samples in one micro-batch of 8 (the window's token mean: every head's own mean over the whole window), the
LoRA weights' update compared. Unpatched: a mean of micro-batch means, measurably off; patched: within 1e-5. With the
hooks on the model inside the PeftModel (before this test), patched was the mean of means too (0.524 off).
"""
from __future__ import annotations

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow
KINDS = ("own-mean-llama", "inline-mean-llama", "qwen3vl-image", "gemma3-image")
CHECKPOINTING = ("none", "reentrant", "non-reentrant")
SCRIPT = r"""
import inspect, json, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch
if sys.argv[1] == "patched":
    import zerofix
    zerofix.patch()
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments
from zerofix.check import models

def update(kind, checkpointing, gas, batch):
    # task_type CAUSAL_LM, as LLaMA-Factory and ms-swift wrap: its tuner calls the model's forward directly
    model = get_peft_model(models.build_model(kind, 0), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM",
        target_modules=r".*language_model.*\.(q_proj|v_proj)|^model\.layers.*\.(q_proj|v_proj)"))
    task = models.task_of(kind)
    samples = [models.sample(i, 0, task) for i in range(8)]
    if "mm_token_type_ids" in inspect.signature(model.get_base_model().forward).parameters:
        for s in samples:  # 5.6's Qwen3-VL reads the image's tokens from its processor's types (1: image)
            s["mm_token_type_ids"] = (s["input_ids"] == models.IMAGE_TOKEN).long()
    ckpt = {} if checkpointing == "none" else {"gradient_checkpointing": True, "gradient_checkpointing_kwargs":
                                               {"use_reentrant": checkpointing == "reentrant"}}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=gas, max_steps=1, learning_rate=5.0, optim="sgd",
                             lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", max_grad_norm=0, remove_unused_columns=False, **ckpt)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trained.items()}
    Trainer(model=model, args=args, train_dataset=samples, data_collator=models.stack).train()
    return torch.cat([(p.detach() - before[n]).flatten() for n, p in trained.items()]).double()

out = {}
for kind in sys.argv[2].split(","):
    for checkpointing in sys.argv[3].split(","):
        row = {"window": update(kind, checkpointing, 4, 2).tolist()}
        if sys.argv[1] == "unpatched":  # the reference: the window's 8 samples in one micro-batch
            row["big"] = update(kind, checkpointing, 1, 8).tolist()
        out[f"{kind}/{checkpointing}"] = row
print("RESULT" + json.dumps(out))
"""


def measure(variant: str) -> dict:
    proc = run_python(SCRIPT, args=(variant, ",".join(KINDS), ",".join(CHECKPOINTING)), timeout=600,
                      env={"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"})
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.stack("llamafactory")
def test_own_mean_heads_under_lora_and_checkpointing_reach_the_token_mean():
    import torch

    unpatched, patched = measure("unpatched"), measure("patched")
    for key, row in unpatched.items():
        big = torch.tensor(row["big"])
        bug = float((torch.tensor(row["window"]) - big).abs().max() / big.abs().max())
        fixed = float((torch.tensor(patched[key]["window"]) - big).abs().max() / big.abs().max())
        print(f"{key}: unpatched {bug:.3g}, patched {fixed:.3g}")
        assert bug > 0.05, (key, bug)  # a mean of micro-batch means
        assert fixed < 1e-5, (key, fixed)  # the window's token mean
