"""Trainer with gradient accumulation on a tiny model: without DeepSpeed (1 process or DDP over gloo),
or through DeepSpeed with ``--zero-stage N``.

Writes, per variant (``unpatched`` and/or ``patched``): ``<out>/<variant>/rank{r}.json`` with the
sample indices each rank consumed per optimizer step, and (rank 0) ``final.pt``; ``<out>/init.pt`` holds
the initial weights. ``--zerofix both`` trains unpatched, then calls ``zerofix.patch()`` and trains a new
Trainer, which also exercises patching after transformers was imported.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from pathlib import Path

from zerofix.check.files import write_whole
from zerofix.check.session import collect_and_freeze, freeze_once


# compute_loss overrides of issue 40, each around the base Trainer.compute_loss (the model's own loss):
# logged-count: logs float(num_items_in_batch) and keeps .item(); deepcopy-count: deep-copies the count first;
# hand-divided: divides the loss by gradient_accumulation_steps itself (the classifier's natural workaround);
# hand-divided-stated: the same, stated with zerofix.loss_is_scaled_for_ga(trainer);
# late-count: the first optimizer step returns the micro-batch's token mean, later ones the model's own loss.
# Issue 46's rows. The causal LM's token sum divided by the count through a route the watch cannot follow (unknown:
# upstream's path and a WARNING): torch.tensor(n), torch.from_numpy(n.numpy()), n.item(), a TorchScript division, a
# compute_loss_func under torch.compile(fullgraph=True); or through one it can (divided): the model's own loss handed
# copy.deepcopy(n); a micro-batch mean that touches the count without dividing (unknown): + 0 * n, * (n > 0),
# + 1e-3 * sum(p ** 2) / n;
# kept-count: the model's loss, with a buffer, a running sum and the count itself kept by the trainer (their classes
# after the run are recorded); bypass: a training_step override that calls accelerator.backward itself.
DIVISOR_ROUTES = ("count-tensor", "count-numpy", "count-item", "count-jit", "compiled-func")
COUNT_ROWS = DIVISOR_ROUTES + ("deepcopy-model", "plus-zero", "plus-zero-mean", "times-positive", "plus-reg-mean",
                               "kept-count", "bypass")
# Issue 51's rows. The token sum divided by the count through an identity real code writes (divided): a chunked sum
# started from a Python 0, Python's sum(), an accumulator from n.new_zeros(()); s / (n + 1e-8), s / maximum(n, 1),
# where(n > 0, s / n, 0 * s), nan_to_num(s / n). zeros-like-mean: the micro-batch mean plus torch.zeros_like(n)
# (independent). A value equal to the steps (issue 58: a coincidence, not a statement): steps-divided-mean, the
# micro-batch mean divided by gradient_accumulation_steps where the Trainer hands the count (ms-swift's RLHF trainers);
# times-steps, the model's loss times the steps, and count-over-steps, the model handed n / steps (hand fixes of 5.2 -
# 5.5.3's second division, or loss weights). plus-z-loss: the model's loss plus 0.01 times a z-loss of its logits (a sum of two powers: unknown).
IDIOM_ROWS = ("sum-from-zero", "python-sum", "new-zeros-sum", "plus-eps", "maximum-one", "where-positive",
              "nan-to-num")
STATED_ROWS = ("zeros-like-mean", "steps-divided-mean", "times-steps", "count-over-steps", "plus-z-loss")
# Issue 58's coincidences, a value equal to GAS that is not a statement: through a compute_loss_func (the Trainer
# multiplies its loss by the processes afterwards) the token mean / GAS (ms-swift's RLHF form), 4.0 * (s / n) (a loss
# weight; also as (s / n) * torch.tensor(4.0), issue 69), s / n / GAS (a double division); a compute_loss override returning the average of four micro-batch-mean
# terms, (a + b + c + d) / 4 (at GAS 4); and the model's own loss divided by GAS (a double division).
COINCIDENCE_ROWS = ("func-steps-divided-mean", "func-weighted-sum", "func-tensor-weighted-sum", "func-steps-divided-sum",
                    "four-term-mean", "count-and-steps-divided")
USER_LOSSES = (("logged-count", "deepcopy-count", "hand-divided", "hand-divided-stated", "late-count") + COUNT_ROWS
               + IDIOM_ROWS + STATED_ROWS + COINCIDENCE_ROWS)


def idiom_loss(idiom: str, token_losses, count):
    """The token sum divided by the count, written as ``idiom`` (IDIOM_ROWS); ``token_losses``: per token, 0 where
    ignored."""
    import torch

    chunks = token_losses.split(5)
    s = token_losses.sum()
    if idiom == "sum-from-zero":
        tot = 0
        for c in chunks:
            tot += c.sum() / count
        return tot
    if idiom == "python-sum":
        return sum(c.sum() / count for c in chunks)
    if idiom == "new-zeros-sum":
        acc = count.new_zeros((), dtype=s.dtype)
        for c in chunks:
            acc += c.sum() / count
        return acc
    if idiom == "plus-eps":
        return s / (count + 1e-8)
    if idiom == "maximum-one":
        return s / torch.maximum(count, torch.ones_like(count))
    if idiom == "where-positive":
        return torch.where(count > 0, s / count, 0 * s)
    if idiom == "nan-to-num":
        return torch.nan_to_num(s / count)
    raise ValueError(idiom)


def _divide(total, count):
    return total / count


def divisor_loss(route: str, total, count):
    """The token sum divided by the count through ``route`` (DIVISOR_ROUTES)."""
    import torch

    if route == "count-tensor":
        return total / torch.tensor(count)
    if route == "count-numpy":
        return total / torch.from_numpy(count.numpy())
    if route == "count-item":
        return total / count.item()
    if route == "count-jit":
        return torch.jit.script(_divide)(total, count)
    raise ValueError(route)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="causal-lm", help="a kind of zerofix.check.models, or hf:<shrunk config file>")
    p.add_argument("--loss", default="model", choices=("model", "subclass-mean", "func-mean") + USER_LOSSES,
                   help="who computes the loss: the model, a Trainer subclass's compute_loss returning the micro-batch "
                   "mean, or a compute_loss_func returning it (both ignore num_items_in_batch); or one of issue 40's "
                   "compute_loss overrides (USER_LOSSES)")
    p.add_argument("--gas", type=int, default=8)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--samples", type=int, default=0, help="dataset size (default: exactly --steps windows)")
    p.add_argument("--epochs", type=int, default=1, help="passes over a --samples dataset")
    p.add_argument("--lr", type=float, default=5.0,
                   help="large, so the update dominates the fp32 rounding of weights near 1.0 (norms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zerofix", choices=("off", "on", "both", "env", "repatched"), default="both",
                   help="env: leave activation to ZEROFIX / zerofix run; repatched: patch(), unpatch(), patch() "
                   "after transformers is imported, then train")
    p.add_argument("--no-average-tokens", action="store_true")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="train through DeepSpeed with this ZeRO stage (default: no DeepSpeed)")
    p.add_argument("--ds-config", default=None, help="JSON file: a user's resolved DeepSpeed configuration, used "
                   "instead of the scenario's (zerofix check --deepspeed); needs --zero-stage")
    p.add_argument("--dispatch", action="store_true", help="accelerate's dispatch_model(force_hooks=True) first")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=None,
                   help="train through accelerate's FSDP (version 1 or 2), on CPU too (zerofix.check.fsdp_cpu)")
    p.add_argument("--fsdp-config", default=None, help="JSON file: a user's fsdp_config for TrainingArguments "
                   "(zerofix check --fsdp-config); needs --fsdp")
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--label-smoothing", type=float, default=0.0, help="TrainingArguments' label_smoothing_factor")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (NCCL between ranks): the GPU tier")
    p.add_argument("--cells", default=None,
                   help="JSON file: a list of cells, each {name, model, gas, samples, epochs, average_tokens, lr}; "
                   "every cell is trained per variant in this one job (results under <out>/<name>/)")
    p.add_argument("--opt-in", default="", help="comma list of opt-in entries the patched variant applies too "
                   "(transformers-trainer-chunked-loss: the Trainer's loss without the full logits)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def cell_args(args, cell: dict):
    """The scenario's arguments for one cell of ``--cells``."""
    cell_args = argparse.Namespace(**vars(args))
    cell_args.model, cell_args.gas = cell["model"], cell["gas"]
    cell_args.loss = cell.get("loss", "model")
    cell_args.dispatch = cell.get("dispatch", args.dispatch)
    cell_args.samples = cell.get("samples", 0)
    cell_args.epochs = cell.get("epochs", 1)
    average = cell.get("average_tokens", True)  # None: the installed release's default
    cell_args.no_average_tokens = None if average is None else not average
    cell_args.lr = cell.get("lr", args.lr)
    cell_args.bs = cell.get("bs", args.bs)
    cell_args.max_grad_norm = cell.get("clip", args.max_grad_norm)
    cell_args.label_smoothing = cell.get("label_smoothing", args.label_smoothing)
    cell_args.bf16 = cell.get("bf16", args.bf16)
    cell_args.fp16 = cell.get("fp16", args.fp16)
    return cell_args


def deepspeed_config(stage: int) -> dict:
    # No train_batch_size: "auto" is resolved before the process group exists.
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",  # max_grad_norm=0 -> 0 (DeepSpeed >= 0.19 would default to 1.0)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    }


def fsdp_arguments(args) -> dict:
    """TrainingArguments' FSDP settings: the user's fsdp_config where given, else a full shard of every layer.
    sync_module_states looks up an accelerator to broadcast from (FSDP1 in torch, both versions in accelerate
    <= 1.10's plugin), which a CPU run lacks; every rank builds the same weights from the seed, so the broadcast
    changes nothing and is left out on CPU."""
    if args.fsdp is None:
        return {}
    config = json.loads(Path(args.fsdp_config).read_text()) if args.fsdp_config else {}
    config = {**config, "version": args.fsdp}
    if not args.cuda:
        config.setdefault("sync_module_states", False)
    # transformers < 5 leaves the version to accelerate's environment, as `accelerate launch` sets it
    os.environ["FSDP_VERSION"] = str(args.fsdp)
    return {"fsdp": "full_shard", "fsdp_config": config}


def user_config(args) -> dict | None:
    """A user's resolved DeepSpeed configuration (``--ds-config``), or None."""
    return json.loads(Path(args.ds_config).read_text()) if args.ds_config else None


@contextlib.contextmanager
def steps_without_grad_mode():
    """DeepSpeed 0.18.7 - 0.18.9's ZeRO-1/2 step writes into views of a flat buffer built with an autograd graph,
    which raises on gloo unless grad mode is off (deepspeed-zero12-flat-buffer fixes it, but the unpatched runs must
    train too). A raw loop wraps engine.step() in torch.no_grad(); the Trainer cannot, so the scenario does it here,
    for the length of its run only: a later run in the same session (tests/test_deepspeed_accumulation.py's
    ``-gradstep`` cells step in grad mode) gets DeepSpeed's own step back."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.__dict__["step"]

    def step(self, *args, **kwargs):
        with torch.no_grad():
            return original(self, *args, **kwargs)

    DeepSpeedZeroOptimizer.step = step
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.step = original


def final_weights(model, zero_stage, wrapped=None) -> dict:
    """Full parameters on every rank. Under FSDP gathered from the shards (collective); under ZeRO-3 from the optimizer's fp32 partitions (collective):
    on deepspeed 0.18.9 a GatheredParameters read of the trained model sometimes returned garbage
    (updates of 1e9 to 1e28 in 2 of 10 runs, unpatched and patched alike)."""
    if wrapped is not None:  # FSDP
        from zerofix.check.fsdp_cpu import full_state

        return full_state(model, wrapped)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # .cpu(): the GPU tier
    if zero_stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param

        import deepspeed

        gathered = {}  # a tied weight (Gemma 3's lm_head is its embeddings) under each of its names, gathered once
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in gathered:
                state[name] = gathered[id(param)]
                continue
            full = safe_get_full_fp32_param(param)
            if full is None and not param.requires_grad:  # frozen (PEFT's base): no optimizer copy, gather it
                with deepspeed.zero.GatheredParameters([param]):
                    full = param.detach().clone()
            if full is None:
                raise RuntimeError(f"no fp32 copy of {name}: requires_grad={param.requires_grad} "
                                   f"ds_id={hasattr(param, 'ds_id')} z3={hasattr(param, '_z3_optimizer')}")
            state[name] = gathered[id(param)] = full.detach().cpu().clone()
    return state


def train(args, variant: str, out: Path, world: int, rank: int) -> None:
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import zerofix
    from zerofix.check import models
    from zerofix.check.fsdp_cpu import engine_facts

    if args.fsdp is not None:
        # accelerate's state outlives a Trainer: an FSDP plugin and its mixed precision from the previous cell would
        # be this one's (transformers < 5 keep it); each cell starts from the process group alone
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)
        for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_MIXED_PRECISION"))]:
            del os.environ[key]  # so are the FSDP_* and mixed-precision variables TrainingArguments exported
    if args.zero_stage == 3 and (args.bf16 or args.fp16 or models.has_sub_models(args.model)):
        # Each variant builds its model as the first one did, outside DeepSpeed's zero.Init: the previous variant's
        # TrainingArguments leave transformers' DeepSpeed configuration live, and a model built under it is built
        # partitioned, which here is not the first build: a classifier keeps an unpartitioned float32 head among bf16
        # parameters (ZeRO-3 then stops on mixed dtypes, measured on 4.57 - 5.23, H100 and CPU), and on transformers
        # 5.3 a model whose parts are built by ``_from_config`` (Qwen2.5-VL's vision tower and text model) leaves the
        # weights its ``_init_weights`` sets through a child module as ``torch.empty`` made them: now and then 1e27 or
        # nan, and the vlm rows' updates changed from run to run (5.24 gathers those too). Only there: unset in every
        # ZeRO run, the check's later DeepSpeed bf16 rows on 0.18.9 moved by a few roundings with the order of the
        # runs (tests/test_session.py, measured again with every ZeRO-3 Trainer run unset); the other fp32 ZeRO-3
        # runs keep the partitioned second build they always had.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    model = models.build_model(args.model, args.seed)
    freeze_once()  # see ds_accumulation: DeepSpeed 0.18.x's gc.collect() calls would scan every library object
    if rank == 0 and not (out / "init.pt").exists():
        torch.save(model.state_dict(), out / "init.pt")
    size = args.samples or args.steps * args.gas * args.bs * world
    dataset = models.IndexedDataset(size, args.seed, models.task_of(args.model))
    windows: dict[int, list[list[int]]] = {}

    class RecordingTrainer(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def _record(self, inputs):
            """The samples of one micro-batch, once per Trainer call (zerofix may run a handed micro-batch's
            Trainer.training_step again: issue 51, item 2)."""
            windows.setdefault(self.state.global_step, []).append([int(i) for i in inputs["sample_idx"]])

        if args.loss != "bypass":
            def training_step(self, model, inputs, *a, **k):
                self._record(inputs)
                return super().training_step(model, inputs, *a, **k)

        def compute_loss(self, model, inputs, *a, **k):
            inputs.pop("sample_idx", None)
            count = k.get("num_items_in_batch", a[1] if len(a) > 1 else None)
            if args.loss == "subclass-mean" or (args.loss == "late-count" and self.state.global_step == 0):
                labels = inputs.pop("labels")  # a user's own loss: the micro-batch's token mean, no super()
                return models.next_token_ce(model(**inputs).logits, labels, "mean")
            if args.loss in DIVISOR_ROUTES[:-1]:
                labels = inputs.pop("labels")
                return divisor_loss(args.loss, models.next_token_ce(model(**inputs).logits, labels, "sum"), count)
            if args.loss in ("plus-zero-mean", "times-positive", "plus-reg-mean"):
                labels = inputs.pop("labels")
                mean = models.next_token_ce(model(**inputs).logits, labels, "mean")
                if args.loss == "plus-reg-mean":  # a small regulariser divided by the count, on a mean
                    return mean + 1e-3 * sum((p ** 2).sum() for p in model.parameters()) / count
                return mean + 0 * count if args.loss == "plus-zero-mean" else mean * (count > 0)
            if args.loss == "plus-zero":
                return super().compute_loss(model, inputs, *a, **k) + 0 * count
            if args.loss in IDIOM_ROWS:
                labels = inputs.pop("labels")
                return idiom_loss(args.loss, models.next_token_ce(model(**inputs).logits, labels, "none"), count)
            if args.loss == "zeros-like-mean":
                labels = inputs.pop("labels")
                return models.next_token_ce(model(**inputs).logits, labels, "mean") + torch.zeros_like(count)
            if args.loss == "steps-divided-mean":  # ms-swift 4.6's RLHF trainers, as they write it
                labels = inputs.pop("labels")
                loss = models.next_token_ce(model(**inputs).logits, labels, "mean")
                if count is not None and self.model_accepts_loss_kwargs:
                    loss = loss / self.args.gradient_accumulation_steps
                return loss
            if args.loss == "times-steps":
                return super().compute_loss(model, inputs, *a, **k) * self.args.gradient_accumulation_steps
            if args.loss == "count-and-steps-divided":
                return super().compute_loss(model, inputs, *a, **k) / self.args.gradient_accumulation_steps
            if args.loss == "four-term-mean":  # four terms, each the micro-batch's token mean, computed four ways
                labels = inputs.pop("labels")
                logits = model(**inputs).logits
                terms = [models.next_token_ce(logits, labels, "mean"),
                         models.next_token_ce(logits, labels, "sum") / (labels[..., 1:] != -100).sum(),
                         models.next_token_ce(logits.double(), labels, "mean").float(),
                         models.next_token_ce(logits, labels, "mean").clone()]
                return (terms[0] + terms[1] + terms[2] + terms[3]) / 4
            if args.loss == "count-over-steps":
                steps = self.args.gradient_accumulation_steps
                return super().compute_loss(model, inputs, num_items_in_batch=count / steps)
            if args.loss == "plus-z-loss":
                loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **k)
                return loss + 0.01 * torch.logsumexp(outputs.logits, dim=-1).pow(2).mean()
            if args.loss == "deepcopy-model":
                return super().compute_loss(model, inputs, num_items_in_batch=copy.deepcopy(count))
            if args.loss == "kept-count":
                self.zerofix_kept = getattr(self, "zerofix_kept", {"norm": torch.zeros(()),
                                                                   "seen": torch.zeros((), dtype=count.dtype)})
                self.zerofix_kept["norm"].copy_(count)
                self.zerofix_kept["seen"].add_(count)
                self.zerofix_kept["count"], self.zerofix_kept["float"] = count, count.double()
                loss = super().compute_loss(model, inputs, *a, **k)
                self.zerofix_kept["running"] = self.zerofix_kept.get("running", torch.zeros(())) + loss.detach()
                return loss
            if args.loss == "logged-count" and count is not None:  # (a head the Trainer never hands a count: None)
                self.zerofix_logged = (float(count), count.item())
            if args.loss == "deepcopy-count":
                self.zerofix_copied = copy.deepcopy(count)
            loss = super().compute_loss(model, inputs, *a, **k)
            if args.loss.startswith("hand-divided"):
                loss = loss / self.args.gradient_accumulation_steps
            return loss

        if args.loss == "bypass":
            def training_step(self, model, inputs, num_items_in_batch=None):
                """A user's step that never calls Trainer.training_step (issue 46, item 4)."""
                self._record(inputs)
                model.train()
                loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
                self.accelerator.backward(loss)
                return loss.detach()

    def divided_loss_func(outputs, labels, num_items_in_batch=None):
        """A compute_loss_func dividing the token sum by the count (compiled below: the compiled-func row)."""
        return models.next_token_ce(outputs.logits, labels, "sum") / num_items_in_batch

    def mean_loss_func(outputs, labels, num_items_in_batch=None):
        """A compute_loss_func that ignores num_items_in_batch: the micro-batch's token mean."""
        return models.next_token_ce(outputs.logits, labels, "mean")

    def coincidence_loss_func(outputs, labels, num_items_in_batch=None):
        """Issue 58's compute_loss_func rows: a value equal to gradient_accumulation_steps in the loss."""
        steps = training_args.gradient_accumulation_steps
        if args.loss == "func-steps-divided-mean":
            return models.next_token_ce(outputs.logits, labels, "mean") / steps
        total = models.next_token_ce(outputs.logits, labels, "sum")
        if args.loss == "func-weighted-sum":
            return float(steps) * (total / num_items_in_batch)
        if args.loss == "func-tensor-weighted-sum":  # the same weight as a 0-d tensor (issue 69)
            return (total / num_items_in_batch) * torch.tensor(float(steps))
        return total / num_items_in_batch / steps

    training_args = TrainingArguments(
        output_dir=str(out / f"trainer-{variant}"), per_device_train_batch_size=args.bs,
        gradient_accumulation_steps=args.gas, max_steps=args.steps if not args.samples else -1,
        num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, bf16=args.bf16, fp16=args.fp16, optim="sgd",
        label_smoothing_factor=args.label_smoothing,
        report_to="none",
        save_strategy="no",
        logging_strategy="no", use_cpu=not args.cuda, seed=args.seed, dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True,
        **({} if args.no_average_tokens is None else {"average_tokens_across_devices": not args.no_average_tokens}),
        **({"ddp_backend": "gloo"} if world > 1 and not args.cuda else {}),
        **({"deepspeed": user_config(args) or deepspeed_config(args.zero_stage)} if args.zero_stage is not None else {}),
        **fsdp_arguments(args),
    )
    vdir = out / variant
    vdir.mkdir(parents=True, exist_ok=True)

    class Snapshots(TrainerCallback):
        """The weights after every optimizer step, so each window is compared from where the run stood
        (over several windows, float32 rounding would otherwise compound into the comparison)."""

        def on_train_begin(self, train_args, state, control, **kwargs):
            # This variant's own start: a model built after a ZeRO-3 Trainer is built partitioned, and its
            # initialisation need not equal the first build's (Llama's classifier differs on 5.23). FSDP1 is not
            # read here but taken as built: with this read the scenario's FSDP1 runs stopped in torch ("Non-root
            # FSDP instance's `_is_root` should not have been set yet", transformers 5.17 / accelerate 1.15, H100),
            # without it they train (H200); a plain Trainer trains with or without such a read
            # (tools/fsdp1_probe.py). Which part of this two-variant run makes the read fail is not established.
            if built is not None:  # FSDP1
                weights = built
            else:
                weights = final_weights(model, args.zero_stage, fsdp_wrapped())
            if rank == 0:
                torch.save(weights, vdir / "init.pt")

        def on_step_end(self, train_args, state, control, **kwargs):
            weights = final_weights(model, args.zero_stage, fsdp_wrapped())  # collective (ZeRO-3, FSDP)
            if rank == 0:
                torch.save(weights, vdir / f"step{state.global_step}.pt")
            engine_norm = getattr(trainer.model_wrapped, "get_global_grad_norm", None)  # what the Trainer logs
            if engine_norm is not None:
                norm = engine_norm()
                grad_norms.append(None if norm is None else float(norm))

    def fsdp_wrapped():
        return trainer.model_wrapped if args.fsdp else None

    built = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if args.fsdp == 1 else None

    grad_norms = []  # DeepSpeed's global gradient norm after each optimizer step
    extra = {"compute_loss_func": mean_loss_func} if args.loss == "func-mean" else {}
    if args.loss.startswith("func-") and args.loss in COINCIDENCE_ROWS:
        extra = {"compute_loss_func": coincidence_loss_func}
    if args.loss == "compiled-func":
        # backend="eager": the entry hands any compiled loss function the plain count whatever the backend (Inductor
        # would add a C++ build of tens of seconds per run)
        extra = {"compute_loss_func": torch.compile(divided_loss_func, fullgraph=True, backend="eager")}
    if args.dispatch:  # accelerate's device hooks on every layer, as device_map="auto" sets them (issue 40)
        from accelerate import dispatch_model

        model = dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)
    trainer = RecordingTrainer(model=model, args=training_args, train_dataset=dataset,
                               data_collator=models.stack, callbacks=[Snapshots()], **extra)
    if args.loss == "hand-divided-stated":
        zerofix.loss_is_scaled_for_ga(trainer)
    with _zerofix_warnings() as said:  # what zerofix logged at WARNING in this cell's run (its own log only)
        trainer.train()
    weights = final_weights(model, args.zero_stage, fsdp_wrapped())
    if rank == 0:
        torch.save(weights, vdir / "final.pt")
    record = {
        "rank": rank, "world": world, "variant": variant, "model": args.model, "loss": args.loss, "gas": args.gas,
        "average_tokens": bool(getattr(training_args, "average_tokens_across_devices", False)), "cell_dir": out.name,
        "windows": [windows[s] for s in sorted(windows)], "grad_norms": grad_norms,
        "status": [r.to_dict() for r in zerofix.status()],
        "engine": engine_facts(trainer) if args.fsdp else None,
        # where the weights trained: the GPU tier asserts "cuda" (a Trainer without a GPU falls back to the CPU)
        "device": str(next(trainer.model_wrapped.parameters()).device),
        # fp16's loss scaling skips a step whose gradients overflow: an update of 0 is then no verdict on the loss
        "step_skipped": bool(getattr(trainer.accelerator, "optimizer_step_was_skipped", False)),
        # what the trainer kept from its steps (the kept-count row): each one's class after the run
        "kept_types": {k: type(v).__name__ for k, v in getattr(trainer, "zerofix_kept", {}).items()},
        "zerofix_warnings": said,
    }
    write_whole(vdir / f"rank{rank}.json", json.dumps(record))


@contextlib.contextmanager
def _zerofix_warnings():
    """The messages zerofix's logger and the Trainer log's zerofix lines (transformers.zerofix) give at WARNING while
    the block runs."""
    import logging

    said = []

    class Capture(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Capture(logging.WARNING)
    loggers = [logging.getLogger("zerofix"), logging.getLogger("transformers.zerofix")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield said
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def run(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not args.cuda:
        from accelerate import PartialState

        PartialState(backend="gloo")  # accelerate >= 1.13 on CPU otherwise sees one process
    with contextlib.ExitStack() as stack:
        if args.zero_stage is not None:
            stack.enter_context(steps_without_grad_mode())
        if args.fsdp is not None and not args.cuda:
            from zerofix.check.fsdp_cpu import fsdp_on_cpu

            stack.enter_context(fsdp_on_cpu())
        _train_variants(args, out, world, rank)


def _train_variants(args, out: Path, world: int, rank: int) -> None:
    import zerofix

    runs = [(args, out)]
    if args.cells:
        cells = json.loads(Path(args.cells).read_text())
        runs = [(cell_args(args, cell), out / cell["name"]) for cell in cells]
        for _, cell_out in runs:
            cell_out.mkdir(parents=True, exist_ok=True)
    variants = {"off": ["unpatched"], "on": ["patched"], "both": ["unpatched", "patched"], "env": ["env"],
                "repatched": ["repatched"]}
    for variant in variants[args.zerofix]:
        if variant == "patched":
            zerofix.patch(opt_in=[i for i in args.opt_in.split(",") if i])
        if variant == "repatched":  # every wrapper installed, removed and installed again before training
            import transformers.trainer  # noqa: F401

            zerofix.patch()
            zerofix.unpatch()
            zerofix.patch()
        for run_args, run_out in runs:
            train(run_args, variant, run_out, world, rank)
            collect_and_freeze()  # see ds_accumulation: the next trainer's collections skip what this one left


if __name__ == "__main__":
    from zerofix.check.rank import entry

    entry(run)
