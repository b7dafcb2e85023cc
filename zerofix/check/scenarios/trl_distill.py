"""TRL ``DistillationTrainer`` (on-policy, no vLLM) under ZeRO-3 (``accelerate launch``, ``zero3_init_flag:
true``): a tiny student and a tiny teacher saved locally, both partitioned, and the Trainer's own step.

TRL 1.10 - 1.14 compute the divergence in ``_chunked_divergence_loss``, chunk by chunk; each chunk gathers the
student's and the teacher's head itself, and again when backward recomputes the chunk, so a rank's number of
gathers (collectives) follows its number of completion tokens. Completions end at EOS, so ranks count different
numbers of tokens: EOS is made likely (the heads' EOS row is scaled up) so that with ``CHUNK`` rows per chunk
the ranks run different chunk counts within the first steps (the record shows them).

- ``--chunk N``: rows per chunk (TRL reads its module constant ``_CHUNKED_LM_HEAD_CHUNK_SIZE`` at each call).
  A chunk as large as every rank's token count is one chunk per rank: the full logits of the counted tokens,
  the reference (and the same number of gathers on every rank, so it cannot hang).
- ``--zerofix``: ``zerofix.patch()`` first, before TRL is imported.

Every rank writes ``rank{r}.json``: the train losses, grad norms, and per step its completion tokens, chunk
count, and the explicit gathers of each head (``param.all_gather``, which TRL's ``GatheredParameters`` and
zerofix's ``gathered`` both call).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from zerofix.check.rank import run_and_record
from zerofix.check.scenarios.trl_grpo import prompts
from zerofix.check.scenarios.trl_sft import count_head_gathers, ensure, make_model_dir

PER_DEVICE, MAX_COMPLETION, CHUNK = 2, 12, 4
WHOLE = 4096  # rows per chunk of the reference: more than any rank's completion tokens, one chunk per rank
EOS = 2
EOS_ROW_SCALE = 6.0  # the EOS row of both heads, scaled: completions end at different lengths


def make_models(root: Path) -> tuple[Path, Path]:
    """Student and teacher (different seeds), EOS made likely in both."""
    import torch
    from transformers import AutoModelForCausalLM

    dirs = []
    for name, seed in (("student", 0), ("teacher", 1)):
        path = make_model_dir(root / name, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight[EOS] *= EOS_ROW_SCALE
        model.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zerofix", action="store_true")
    parser.add_argument("--out", required=True)
    run_and_record(parser.parse_args(argv), train)


def train(args) -> dict:
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer
    from trl.trainer import distillation_trainer

    from accelerate import PartialState

    PartialState(backend="gloo")  # accelerate >= 1.13 on CPU otherwise sees one process
    ensure(Path(args.student).parent, make_models)  # student and teacher, side by side
    distillation_trainer._CHUNKED_LM_HEAD_CHUNK_SIZE = args.chunk
    config = DistillationConfig(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=PER_DEVICE,
        max_completion_length=MAX_COMPLETION, beta=args.beta, max_steps=args.steps, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1e6, logging_steps=1,  # logs the norm
        report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
        use_cpu=True, ddp_backend="gloo", use_vllm=False, shuffle_dataset=False,
        model_init_kwargs={"device_map": None}, teacher_model_init_kwargs={"device_map": None},
    )
    steps, tokens, gathers = [], [], {"student": {"n": 0}, "teacher": {"n": 0}}

    class Trainer(DistillationTrainer):
        def training_step(self, model, inputs, *a, **k):
            for counter in gathers.values():
                counter["n"] = 0
            tokens.clear()
            result = super().training_step(model, inputs, *a, **k)
            steps.append({"completion_tokens": sum(tokens), "chunks": sum(max(1, -(-n // args.chunk)) for n in tokens),
                          **{f"{name}_head_gathers": c["n"] for name, c in gathers.items()}})
            return result

        def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
            tokens.append(int(inputs["completion_mask"].sum()))  # after generation: the counted tokens
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    tokenizer.padding_side = "left"
    trainer = Trainer(model=args.student, teacher_model=args.teacher, args=config, train_dataset=prompts(64),
                      processing_class=tokenizer)
    from transformers.integrations import is_deepspeed_zero3_enabled

    heads = {"student": trainer.model.lm_head.weight,
             "teacher": trainer.accelerator.unwrap_model(trainer.teacher_model).lm_head.weight}
    facts = {"zero3": is_deepspeed_zero3_enabled(),
             "heads_are_zero3_params": all(hasattr(h, "ds_id") for h in heads.values())}
    for name, head in heads.items():
        if hasattr(head, "ds_id"):
            count_head_gathers(head, gathers[name])
    trainer.train()
    history = trainer.state.log_history
    return {
        "facts": facts,
        "train_loss": [h["loss"] for h in history if "loss" in h],
        "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
        "eval_loss": [],  # no evaluation (the TRL rows' comparison reads it)
        "steps": steps,
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zerofix.check.rank import entry

    entry(run)
