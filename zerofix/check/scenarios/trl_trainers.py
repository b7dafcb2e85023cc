"""TRL trainers that compute their own loss, scaled by the Trainer (transformers-trainer-scaling): GKDTrainer
(``lmbda=0``: no generation, the generalized JSD of the student against the teacher, a mean over the
micro-batch's counted tokens that ignores ``num_items_in_batch``) and RewardTrainer (a Llama sequence classifier
with one output; TRL states ``loss_is_scaled_for_ga = False``, or ``model_accepts_loss_kwargs = False`` before
transformers 5.19).

For each trainer, unpatched and then patched (``zerofix.patch()`` in the same processes), two runs of one
optimizer step (SGD) over the same samples: GAS=4 with 2 samples per micro-batch, and the reference, GAS=1 with
the window's 8 samples in one micro-batch. Every sample has the same length and the same number of counted tokens,
so the mean of the micro-batch means is the window's mean: the two updates must be equal.

Every rank writes ``rank{r}.json``; rank 0 saves ``<trainer>-<variant>-<gas4|whole>.pt`` (the weights after
the step) and ``<trainer>-init.pt``.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from zerofix.check.scenarios.trl_sft import ensure, make_model_dir
from zerofix.check.session import collect_and_freeze

SEQ, PROMPT, PER_DEVICE, GAS = 10, 4, 2, 4
VOCAB = 64


def make_dirs(root: Path) -> dict:
    return {"student": make_model_dir(root / "student", seed=0), "teacher": make_model_dir(root / "teacher", seed=1)}


def _rows(world: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (SEQ,), generator=g).tolist() for _ in range(PER_DEVICE * GAS * world)]


class _Collate:
    """input_ids, attention_mask, labels (the prompt's positions ignored): every sample counts SEQ - PROMPT; and
    ``prompts`` (trl 1.5.1's GKD slices the logits by its length, as its chat collator provides it)."""

    def __call__(self, items):
        import torch

        ids = torch.tensor([it["input_ids"] for it in items])
        labels = ids.clone()
        labels[:, :PROMPT] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "prompts": ids[:, :PROMPT]}


# SGD learning rates: large, so an update dominates the float32 rounding of weights near 1.0 (the JSD's
# gradients are small: at 2.0 the rounding alone is 2e-3 of GKD's update)
LR = {"gkd": 200.0, "reward": 2.0}


def _common(out: str, gas: int, bs: int, world: int, lr: float) -> dict:
    return dict(output_dir=tempfile.mkdtemp(prefix="zerofix-trl-", dir=out), per_device_train_batch_size=bs,
                gradient_accumulation_steps=gas, max_steps=1, learning_rate=lr, lr_scheduler_type="constant",
                warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, optim="sgd", report_to="none",
                save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                disable_tqdm=True, bf16=False, fp16=False,  # TRL configs default to bf16 where it is supported
                **({"ddp_backend": "gloo"} if world > 1 else {}))


def _sequential(cls):
    from torch.utils.data import SequentialSampler

    class Sequential(cls):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset) if self.args.world_size == 1 else super()._get_train_sampler(*a, **k)

    Sequential.__name__ = cls.__name__
    return Sequential


def gkd(dirs: dict, out: str, gas: int, bs: int, world: int):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:  # trl < 1.5: GKD was not experimental yet
        from trl import GKDConfig, GKDTrainer
    student = AutoModelForCausalLM.from_pretrained(dirs["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(dirs["teacher"], dtype=torch.float32)
    args = GKDConfig(**_common(out, gas, bs, world, LR["gkd"]), lmbda=0.0, beta=0.5, seq_kd=False, max_length=SEQ)
    trainer = _sequential(GKDTrainer)(model=student, teacher_model=teacher, args=args,
                                      train_dataset=Dataset.from_dict({"input_ids": _rows(world)}),
                                      processing_class=AutoTokenizer.from_pretrained(dirs["student"]),
                                      data_collator=_Collate())
    return student, trainer


def reward(dirs: dict, out: str, gas: int, bs: int, world: int):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(5)  # the score head is initialised here, identically in every run
    model = AutoModelForSequenceClassification.from_pretrained(dirs["student"], num_labels=1, dtype=torch.float32)
    rows = _rows(world)
    half = len(rows) // 2
    data = Dataset.from_dict({"chosen_ids": rows[:half] * 2, "rejected_ids": rows[half:] * 2})
    args = RewardConfig(**_common(out, gas, bs, world, LR["reward"]), max_length=SEQ, center_rewards_coefficient=None)
    trainer = _sequential(RewardTrainer)(model=model, args=args, train_dataset=data,
                                         processing_class=AutoTokenizer.from_pretrained(dirs["student"]))
    return model, trainer


TRAINERS = {"gkd": gkd, "reward": reward}


def train(args) -> dict:
    import torch

    import zerofix

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    ensure(Path(args.student).parent, make_dirs)  # student and teacher, side by side (rank 0 makes them)
    dirs = {"student": Path(args.student), "teacher": Path(args.teacher)}
    record = {}
    for variant in ("unpatched", "patched"):
        if variant == "patched":
            zerofix.patch()
        for name in args.trainers.split(","):
            for run, (gas, bs) in (("gas4", (GAS, PER_DEVICE)), ("whole", (1, PER_DEVICE * GAS))):
                model, trainer = TRAINERS[name](dirs, str(out), gas, bs, world)
                if rank == 0 and not (out / f"{name}-init.pt").exists():
                    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}-init.pt")
                trainer.train()
                if rank == 0:
                    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                               out / f"{name}-{variant}-{run}.pt")
                details = [s.runtime for s in zerofix.status() if s.id == "transformers-trainer-scaling"]
                record[f"{name}-{variant}-{run}"] = {"runtime": [dict(d) for d in (details[0] if details else ())][-1:]}
                del model, trainer
                collect_and_freeze()
    return record


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--trainers", default="gkd,reward")
    parser.add_argument("--out", required=True)
    parser.add_argument("--zerofix", action="store_true", help="unused: the scenario patches between its variants")
    from zerofix.check.rank import run_and_record

    run_and_record(parser.parse_args(argv), train)


if __name__ == "__main__":
    from zerofix.check.rank import entry

    entry(run)
