"""A plain Accelerate loop, ``with accelerator.accumulate(model)`` (no Trainer), with or without DeepSpeed.

The loss is each micro-batch's own mean, as a user writes it; accelerate divides by the accumulation
steps (or DeepSpeed does, under ``--zero-stage``), so the loss meant is the mean of the micro-batch means
of a window. Per cell and variant (``unpatched``, then ``zerofix.patch()`` and ``patched``): rank r writes
``<out>/<cell>/<variant>/rank{r}.json`` (the sample indices of every window) and rank 0 the weights after
every optimizer step (``step{k}.pt``, ``final.pt``); ``<out>/<cell>/init.pt`` the initial weights.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from zerofix.check.files import write_whole
from zerofix.check.scenarios.trainer_gas import final_weights, steps_without_grad_mode, user_config
from zerofix.check.session import collect_and_freeze, freeze_once

BATCH = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True, help="JSON file: a list of {name, model, gas, samples[, epochs, lr]}")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None)
    p.add_argument("--ds-config", default=None, help="JSON file: a user's resolved DeepSpeed configuration "
                   "(zerofix check --deepspeed), used instead of the scenario's; needs --zero-stage")
    p.add_argument("--lr", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zerofix", choices=("off", "on", "both"), default="both")
    p.add_argument("--opt-in", default="", help="comma list of opt-in fix ids the patched variant applies too")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def deepspeed_plugin(stage: int, gas: int, user: dict | None = None):
    from accelerate.utils import DeepSpeedPlugin

    if user is not None:
        return DeepSpeedPlugin(hf_ds_config={**user, "train_micro_batch_size_per_gpu": BATCH,
                                             "gradient_accumulation_steps": gas})
    return DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # DeepSpeed >= 0.19 would default to 1.0
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    })


def train(args, cell: dict, variant: str, out: Path, world: int, rank: int) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, SequentialSampler

    import zerofix
    from zerofix.check import models

    AcceleratorState._reset_state()  # a fresh Accelerator per cell (the process group stays)
    model = models.build_model(cell["model"], args.seed)
    if rank == 0 and not (out / "init.pt").exists():
        torch.save(model.state_dict(), out / "init.pt")
    kwargs = {"gradient_accumulation_steps": cell["gas"]}
    if args.zero_stage is not None:
        user = user_config(args)
        kwargs["deepspeed_plugin"] = deepspeed_plugin(args.zero_stage, cell["gas"], user)
        if user is not None and user.get("bf16", {}).get("enabled"):
            kwargs["mixed_precision"] = "bf16"
    # cpu=True without DeepSpeed: accelerate 1.15 otherwise sees no distributed setup on CPU (DistributedType.NO,
    # each rank applying its own gradient); with DeepSpeed it must stay False, as it turns DeepSpeed off.
    accelerator = Accelerator(cpu=args.zero_stage is None, **kwargs)
    dataset = models.IndexedDataset(cell["samples"], args.seed)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=SequentialSampler(dataset), collate_fn=models.stack)
    optimizer = torch.optim.SGD(model.parameters(), lr=cell.get("lr", args.lr))
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    vdir = out / variant
    vdir.mkdir(parents=True, exist_ok=True)
    windows, current, steps = [], [], 0
    for batch in (b for _ in range(cell.get("epochs", 1)) for b in loader):
        with accelerator.accumulate(wrapped):
            current.append([int(i) for i in batch.pop("sample_idx")])
            output = wrapped(**batch)
            loss = output["loss"] if isinstance(output, dict) else output.loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:  # the window closed: the optimizer stepped
            windows.append(current)
            current, steps = [], steps + 1
            weights = final_weights(model, args.zero_stage)  # collective under ZeRO-3
            if rank == 0:
                torch.save(weights, vdir / f"step{steps}.pt")
    weights = final_weights(model, args.zero_stage)
    if rank == 0:
        torch.save(weights, vdir / "final.pt")
    record = {"rank": rank, "world": world, "variant": variant, "cell_dir": out.name, "windows": windows,
              "distributed_type": str(accelerator.distributed_type),
              "left_over": current, "status": [r.to_dict() for r in zerofix.status()]}
    write_whole(vdir / f"rank{rank}.json", json.dumps(record))
    accelerator.free_memory()


def run(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        from accelerate import PartialState

        # accelerate >= 1.13 on CPU otherwise sees one process; cpu=True, or it sees DistributedType.NO
        # (each rank applying its own gradient); not under DeepSpeed, which cpu=True turns off.
        PartialState(cpu=args.zero_stage is None, backend="gloo")
    import zerofix
    from zerofix.check import models  # noqa: F401  (transformers, torch imported before the gc freeze)

    freeze_once()  # DeepSpeed 0.18.x's gc.collect() calls would scan every library object
    cells = json.loads(Path(args.cells).read_text())
    variants = {"off": ["unpatched"], "on": ["patched"], "both": ["unpatched", "patched"]}[args.zerofix]
    with steps_without_grad_mode() if args.zero_stage is not None else contextlib.nullcontext():
        for variant in variants:
            if variant == "patched":
                zerofix.patch(opt_in=[f for f in args.opt_in.split(",") if f])
            for cell in cells:
                cell_out = out / cell["name"]
                cell_out.mkdir(parents=True, exist_ok=True)
                train(args, cell, variant, cell_out, world, rank)
                collect_and_freeze()  # see ds_accumulation: the next cell's collections skip what this one left


if __name__ == "__main__":
    from zerofix.check.rank import entry

    entry(run)
