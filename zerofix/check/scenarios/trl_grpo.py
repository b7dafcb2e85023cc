"""TRL ``GRPOTrainer`` (no vLLM, a Python reward) on a tiny model saved locally: one optimizer step per case,
with the inputs of every micro-step recorded, so that the update can be compared with the intended one.

A case is ``{"loss_type": ..., "spg": steps_per_generation, "gas": gradient_accumulation_steps}``, optionally
``"trainer": "gspo_token"`` (``trl.experimental.gspo_token.GRPOTrainer``, its own copy of ``_compute_loss``;
token-level importance sampling, so its loss is dapo's). Every case
trains one window (``max_steps=1``) from the same initial weights with SGD (no momentum, no clipping), 2
prompts per rank and micro-step, ``num_generations=4``, ``beta=0``. Completions always have
``MAX_COMPLETION`` tokens (``min_new_tokens``: no early EOS), so every micro-step counts the same number of
completion tokens; then a generation batch's count is exactly ``steps_per_generation / gas`` times a
window's, and the window's token-mean is what TRL >= 1.9.2 computes too.

Each rank writes ``rank{r}.json`` (per case: the loss, or the error; zerofix's status) and ``{case}-rank{r}.pt``
(the micro-steps' inputs, the parameters before and after, the loss settings): ``reference_update`` turns them
into the intended update, in float64, in one process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import traceback
from pathlib import Path

from zerofix.check.files import write_whole
from zerofix.check.scenarios.trl_sft import VOCAB, ensure, make_model_dir  # the same tiny Llama

PER_DEVICE, NUM_GENERATIONS, MAX_COMPLETION, PROMPT_WORDS = 2, 4, 6, 4
# One SGD step: a large rate makes the update large against the weights, so that after - before (float32)
# loses little of it to rounding
LR = 10.0
RECORDED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
            "old_per_token_logps", "num_items_in_batch")


def case_name(case: dict) -> str:
    trainer = "" if case.get("trainer", "grpo") == "grpo" else f"{case['trainer']}-"
    return f"{trainer}{case['loss_type']}-spg{case['spg']}-gas{case['gas']}"


def reward(completions, **kwargs):
    """A reward that varies within a group: the share of even token ids in the completion."""
    out = []
    for text in completions:
        ids = [int(word[1:]) for word in str(text).split() if word[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


def prompts(n: int):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(11)
    rows = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (PROMPT_WORDS,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({"prompt": rows})


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of {loss_type, spg, gas}")
    parser.add_argument("--zerofix", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.zerofix:
        import zerofix

        zerofix.patch()
    from accelerate import PartialState

    PartialState(backend="gloo")  # accelerate >= 1.13 on CPU otherwise sees one process
    ensure(args.model_dir, make_model_dir)
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "cases": {}}
    for case in json.loads(args.cases):
        try:
            record["cases"][case_name(case)] = train(args, case, out, rank)
            record["cases"][case_name(case)]["scaling"] = _scaling_details()
        except Exception as exc:  # noqa: BLE001 - recorded; the test decides
            record["cases"][case_name(case)] = {"error": f"{type(exc).__name__}: {exc}",
                                                "traceback": traceback.format_exc()[-4000:]}
    import zerofix

    record["status"] = {r.id: r.state for r in zerofix.status()}
    write_whole(out / f"rank{rank}.json", json.dumps(record, indent=1))


def _scaling_details():
    """transformers-trainer-scaling's record of the case's trainer (the last one), or None: whether it acted."""
    import zerofix

    runtime = next((r.runtime for r in zerofix.status() if r.id == "transformers-trainer-scaling"), ())
    return dict(runtime[-1]) if runtime else None


def train(args, case: dict, out: Path, rank: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    if case.get("trainer", "grpo") == "gspo_token":
        from trl.experimental.gspo_token import GRPOTrainer
    else:
        from trl import GRPOTrainer
    name = case_name(case)
    config = GRPOConfig(
        output_dir=str(out / "trainer" / name), per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=case["gas"], steps_per_generation=case["spg"], num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION, generation_kwargs={"min_new_tokens": MAX_COMPLETION},
        loss_type=case["loss_type"], beta=0.0, max_steps=1, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, shuffle_dataset=False, dataloader_num_workers=0,
        disable_tqdm=True, bf16=False, use_cpu=True, ddp_backend="gloo", use_vllm=False,
    )
    micro = []

    class Trainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            if model.training:
                micro.append({k: (v.detach().clone() if hasattr(v, "detach") else v)
                              for k, v in inputs.items() if k in RECORDED and v is not None})
            return super()._compute_loss(model, inputs)

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = Trainer(model=model, reward_funcs=reward, args=config, train_dataset=prompts(64),
                      processing_class=_tokenizer(args.model_dir))
    trainer.train()
    after = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    settings = {"loss_type": case["loss_type"], "temperature": config.temperature, "lr": LR,
                "epsilon_low": trainer.epsilon_low, "epsilon_high": trainer.epsilon_high,
                "vespo": {k: getattr(config, f"vespo_{k}", None) for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}}
    torch.save({"micro": micro, "before": before, "after": after, "settings": settings},
               out / f"{name}-rank{rank}.pt")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"loss": losses, "micro_steps": len(micro),
            "completion_tokens": [int(m["completion_mask"].sum()) for m in micro]}


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    # a causal LM reads no token_type_ids: TRL 0.24 hands the tokenizer's whole output to generate(), which
    # transformers 4.57 refuses with them
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return tokenizer


def reference_update(model_dir, files: list[Path]) -> dict:
    """The intended update of one window, in float64, in one process: the gradient of the sum over every
    micro-step of every rank of ``mask * per_token_loss``, divided by the window's completion tokens (across
    ranks), at the initial weights, times ``-lr``. Per-token losses as TRL defines them for the loss type
    (``dapo``: clipped ratio; ``cispo``: detached clipped ratio times the log-probability; ``vespo``: detached
    gamma weight of the sequence ratio times the log-probability; ``bnpo``: dapo's, normalised by each micro-step's
    own tokens, which is the window's here, where every completion has the same length), with the old log-probabilities each
    micro-step received (its own, detached, where TRL passed none). Returns the reference and measured
    updates (flat float64), the largest difference between the ranks' updates and the window's tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # zerofix check's own progress is on the same terminal
    saved = [torch.load(f, weights_only=False) for f in files]
    settings = saved[0]["settings"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[0]["before"][name].double())
    model.train(False)  # dropout is 0 in the tiny model; eval mode only to be explicit
    window_tokens = sum(float(m["completion_mask"].sum()) for s in saved for m in s["micro"])
    total = 0.0
    for s in saved:
        for m in s["micro"]:
            total = total + _micro_objective(model, m, settings)
    objective = total / window_tokens
    model.zero_grad()
    objective.backward()
    names = [n for n, _ in model.named_parameters()]
    ref = torch.cat([(-settings["lr"] * p.grad).reshape(-1) for _, p in model.named_parameters()])
    # every rank ends with the same parameters (DDP): rank 0's update, and how far the others are from it
    deltas = [torch.cat([(s["after"][n] - s["before"][n]).double().reshape(-1) for n in names]) for s in saved]
    return {"ref": ref.detach(), "got": deltas[0], "window_tokens": window_tokens,
            "rank_spread": max(float((d - deltas[0]).abs().max()) for d in deltas)}


def _micro_objective(model, m: dict, settings: dict):
    import torch

    prompt_ids, completion_ids = m["prompt_ids"], m["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([m["prompt_mask"], m["completion_mask"]], dim=1)
    t = completion_ids.size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -t - 1:-1, :]
    logps = torch.log_softmax(logits / settings["temperature"], dim=-1)
    logp = logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    old = m.get("old_per_token_logps")
    old = logp.detach() if old is None else old.double()
    mask = m["completion_mask"].double()
    adv = m["advantages"].double()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = logp - old
    coef = torch.exp(log_ratio)
    loss_type = settings["loss_type"]
    if loss_type in ("dapo", "bnpo"):  # bnpo: dapo's per-token loss over each micro-step's own tokens (see above)
        clipped = torch.clamp(coef, 1 - settings["epsilon_low"], 1 + settings["epsilon_high"])
        per_token = -torch.min(coef * adv, clipped * adv)
    elif loss_type == "cispo":
        per_token = -torch.clamp(coef, max=settings["epsilon_high"]).detach() * adv * logp
    elif loss_type == "vespo":
        v = settings["vespo"]
        with torch.no_grad():
            seq = torch.clamp(torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True),
                              math.log(1e-8), 20.0)
            k = torch.where(adv >= 0, torch.full_like(adv, v["k_pos"]), torch.full_like(adv, v["k_neg"]))
            lam = torch.where(adv >= 0, torch.full_like(adv, v["lambda_pos"]),
                              torch.full_like(adv, v["lambda_neg"])).clamp(min=1e-4)
            phi = torch.exp(lam + k * seq - lam * torch.exp(seq)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi * adv * logp
    else:
        raise ValueError(f"no reference for loss_type={loss_type!r}")
    return (per_token * mask).sum()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zerofix.check.rank import entry

    entry(run)
