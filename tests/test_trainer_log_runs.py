"""Issue 58, item 3: each run's log is its own and says only what acts. Real Trainer runs in one process (a sweep, a
notebook), each run's zerofix lines (the Trainer's log, ``transformers.zerofix``) captured on their own:

- a first run whose loss zerofix rescales as a micro-batch mean (said during training and at its end), then a second
  Trainer and a second ``train()`` of it: neither repeats the first run's warnings;
- a dense model's start line does not name ``transformers-moe-aux-loss``; an MoE model's run names it once its first
  step used it;
- under ``ZEROFIX_LOSS_IS_SCALED_FOR_GA=0`` with a loss whose verdict is unknown (``mean + 0 * n``), the lines say what
  the statement did, and none says the Trainer's own scaling runs unchanged.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_python

pytestmark = [pytest.mark.slow, pytest.mark.stack("latest", "2026-04")]

SCRIPT = r"""
import json, logging, os, tempfile
import torch
import zerofix
zerofix.patch()
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as hf_logging
from zerofix.check import models

hf_logging.set_verbosity_warning()
runs, current = {}, [None]

class Capture(logging.Handler):
    def emit(self, record):
        runs.setdefault(current[0], []).append(record.getMessage())

hf_logging.get_logger("transformers.zerofix").addHandler(Capture())


class MeanTrainer(Trainer):
    # the micro-batch's token mean, independent of the count (zero_plus: computed from it without dividing: unknown)
    zero_plus = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        loss = models.next_token_ce(model(**inputs).logits, labels, "mean")
        return loss + 0 * num_items_in_batch if self.zero_plus else loss


def train(name, trainer_class=Trainer, kind="causal-lm", trainer=None, **attrs):
    current[0] = name
    if trainer is None:
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=4, max_steps=1, learning_rate=1.0, optim="sgd",
                                 lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                                 logging_strategy="no", max_grad_norm=0, remove_unused_columns=False,
                                 disable_tqdm=True)
        dataset = models.IndexedDataset(8, 0, models.task_of(kind))
        trainer = trainer_class(model=models.build_model(kind), args=args, train_dataset=dataset,
                                data_collator=lambda rows: {k: v for k, v in models.stack(rows).items()
                                                            if k != "sample_idx"})
        for key, value in attrs.items():
            setattr(trainer, key, value)
    trainer.train()
    return trainer


train("mean", MeanTrainer)
second = train("plain")
train("plain-again", trainer=second)
train("moe", kind="moe")
os.environ["ZEROFIX_LOSS_IS_SCALED_FOR_GA"] = "0"
train("stated", MeanTrainer, zero_plus=True)
print("RESULT" + json.dumps(runs))
"""


def test_each_runs_log_is_its_own_and_says_only_what_acts():
    proc = run_python(SCRIPT, env={"HF_HUB_OFFLINE": "1"}, timeout=600)
    runs = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    for name, lines in runs.items():
        print(f"--- {name}"), [print(line) for line in lines]
    mean = "\n".join(runs["mean"])
    assert "warned during training: micro-batch mean term" in mean  # said at the end of its run (5.24: and rescaled)
    for name in ("plain", "plain-again", "moe"):
        text = "\n".join(runs[name])
        assert "act on this run" in runs[name][0] or "acts on this run" in runs[name][0], (name, runs[name])
        assert "warned during training" not in text and "micro-batch mean" not in text, (name, text)
        assert "rescaled" not in text, (name, text)
        assert "MeanTrainer" not in text, (name, text)
    for name in ("mean", "plain", "plain-again", "stated"):  # dense models: the MoE entry is never named
        assert "transformers-moe-aux-loss" not in "\n".join(runs[name]), (name, runs[name])
    moe = [line for line in runs["moe"] if "transformers-moe-aux-loss" in line]
    assert len(moe) == 1 and "acts on this run" in moe[0] and "router auxiliary loss" in moe[0], runs["moe"]
    assert "transformers-moe-aux-loss" not in runs["moe"][0]  # not at the start: once a step used it
    stated = "\n".join(runs["stated"])
    assert "as the statement ZEROFIX_LOSS_IS_SCALED_FOR_GA=0 (a micro-batch mean) says, zerofix changed" in stated \
        or "its first 4 backwards ran as the Trainer runs them" in stated, stated  # 5.3: a mean is right upstream
    assert "runs unchanged" not in stated, stated
    assert "the statement ZEROFIX_LOSS_IS_SCALED_FOR_GA=0 (a micro-batch mean) decides" in stated, stated
