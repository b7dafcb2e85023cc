"""The Trainer's token count for ``num_items_in_batch``, measured on every stack (not a zerofix entry: the
decision and its reasons are in docs/fixes.md, "The Trainer's token count").

A causal LM predicts label t+1 from position t, so position 0's label is never a target. transformers 4.46 -
5.9.0 count ``labels != -100`` over the whole label tensor; 5.10.1 counts ``labels[..., 1:]`` (a causal-LM loss)
or ``shift_labels``. With labels equal to the inputs (nothing masked at position 0), a batch of B sequences
is over-counted by B, and every update is (predicted tokens) / (predicted tokens + B) of the per-predicted-
token mean: 29/33 for the 2 x 2 right-padded sequences of 6-10 tokens here. With position 0 masked (prompt-masked SFT, this project's scenarios) both counts agree.

One process, a real ``Trainer`` on a tiny random Llama, its own ``get_batch_samples`` over two micro-batches.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_python
from zerofix import versions

# one release on each side of the change (the count is read from each release's source in docs/fixes.md)
pytestmark = [pytest.mark.slow, pytest.mark.stack("latest", "2026-04")]

SCRIPT = r"""
import inspect, json, tempfile
import torch
from transformers import Trainer, TrainingArguments
from zerofix.check import models

lengths = [[6, 10], [8, 9]]  # two micro-batches of two right-padded sequences (12 positions)
batches = []
for batch_lengths in lengths:
    ids = torch.randint(1, models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(sum(batch_lengths)))
    mask = (torch.arange(12)[None] < torch.tensor(batch_lengths)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)  # labels = inputs, padding ignored, position 0 counted
    batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, report_to=[],
                         gradient_accumulation_steps=2, use_cpu=True)
trainer = Trainer(model=models.build_model("causal-lm"), args=args)
extra = [torch.device("cpu")] if "device" in inspect.signature(trainer.get_batch_samples).parameters else []
_, counted = trainer.get_batch_samples(iter(batches), 2, *extra)
print("RESULT" + json.dumps({
    "counted": int(counted),
    "all_labels": sum(int((b["labels"] != -100).sum()) for b in batches),
    "predicted": sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches),
}))
"""


def test_the_trainer_counts_what_the_release_is_known_to_count():
    proc = run_python(SCRIPT, env={"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}, timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert (result["predicted"], result["all_labels"]) == (29, 33)  # the 4 sequences' label 0 is the difference
    shifted = versions.version_in_range(versions.installed_version("transformers"), ">=5.10.1")
    assert result["counted"] == (result["predicted"] if shifted else result["all_labels"]), result
