"""A chunked LM loss on a ZeRO-3 partitioned head, inside and outside ``engine.forward``, in one job.

Run under torchrun (gloo, CPU, 2 ranks). Each cell builds a fresh ZeRO-3 engine (every parameter
partitioned: ``stage3_param_persistence_threshold: 0``) from the same initial weights, takes ``STEPS`` SGD
steps and records the full parameters after each, plus how many times the head was gathered in each phase.

Where the loss runs (``mode``):
- ``inside``: in the model's forward, reading ``self.lm_head.weight`` (what TRL's patched forward does);
- ``outside``: ``engine(ids)`` returns hidden states, the loss is computed after it returns;
- ``submodule``: ``engine.module.decoder(ids)`` then the loss, without ``engine.forward`` at all (a custom
  ``compute_loss`` calling ``model.model(...)``; an eval step).

Which loss (``loss``): ``zerofix`` (``zerofix.chunked_cross_entropy``), ``naive`` (the same chunks reading the
weight directly, like TRL 1.5.1's ``chunked_nll``) or ``plain`` (``lm_head(h)`` then ``F.cross_entropy``:
DeepSpeed's own gathers, for comparison). Data are uneven on purpose: rank 1 has fewer counted tokens
(fewer chunks), or none at all (``empty_rank1``).

Writes ``init.pt``, ``<cell>.pt`` (snapshots, rank 0) and ``rank{r}.json``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zerofix.check.files import write_whole
from zerofix.check.session import collect_and_freeze

VOCAB, HIDDEN, BATCH, SEQ, STEPS, LR = 40, 16, 2, 12, 2, 5.0
COUNTS = {"loss_forward": 0, "backward": 0, "other": 0, "api": 0}
_PHASE = ["other"]


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids):
        return torch.tanh(self.body(self.embed(ids)))


class HeadModel(nn.Module):
    def __init__(self, cell: dict):
        super().__init__()
        self.cell = cell
        self.decoder = Decoder()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=cell["bias"])
        if cell["tied"]:
            self.lm_head.weight = self.decoder.embed.weight

    def forward(self, ids, labels=None):
        hidden = self.decoder(ids)
        if labels is None:
            return hidden
        return head_loss(self, hidden, labels, self.cell)


def head_loss(model, hidden, labels, cell):
    with phase("loss_forward"):
        if cell["loss"] == "zerofix":
            import zerofix

            return zerofix.chunked_cross_entropy(hidden, model.lm_head.weight, labels, model.lm_head.bias,
                                                 chunk_size=cell["chunk_size"])
        if cell["loss"] == "naive":
            h, y = hidden.reshape(-1, HIDDEN), labels.reshape(-1)
            keep = y != -100
            h, y = h[keep], y[keep]
            total = hidden.sum() * 0
            for s in range(0, h.shape[0], cell["chunk_size"]):
                logits = h[s:s + cell["chunk_size"]] @ model.lm_head.weight.t()
                if model.lm_head.bias is not None:
                    logits = logits + model.lm_head.bias
                total = total + F.cross_entropy(logits, y[s:s + cell["chunk_size"]], reduction="sum")
            return total / max(1, h.shape[0])
        logits = model.lm_head(hidden)
        return per_rank_loss(logits, labels)


def reference_step(before: dict, step: int, cell: dict, world: int) -> tuple[dict, dict]:
    """(weights loaded from ``before``, weights after one float64 SGD step on step ``step``'s batches of every
    rank): the single-process reference of one step. DeepSpeed averages the ranks' gradients, so the
    objective is the mean of the per-rank losses. A tied head takes lm_head.weight, loaded last, as in the run."""
    model = HeadModel(cell).double()
    model.load_state_dict({k: v.double() for k, v in before.items()}, strict=False)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    total = sum(per_rank_loss(model.lm_head(model.decoder(ids)), labels)
                for ids, labels in (batch(step, r, cell) for r in range(world))) / world
    total.backward()
    return start, {name: start[name] - LR * p.grad for name, p in model.named_parameters()}


def per_rank_loss(logits, labels):
    """Mean over this rank's counted tokens; 0 (not NaN) when there are none."""
    flat, y = logits.reshape(-1, VOCAB), labels.reshape(-1)
    total = F.cross_entropy(flat, y, ignore_index=-100, reduction="sum")
    return total / max(1, int((y != -100).sum()))


class phase:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.prev = _PHASE[0]
        _PHASE[0] = self.name

    def __exit__(self, *exc):
        _PHASE[0] = self.prev


def batch(step: int, rank: int, cell: dict):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # Rank 1 counts fewer tokens (so it has fewer chunks), or none at all.
    drop = 0.1 if rank == 0 else 0.6
    labels[torch.rand(BATCH, SEQ, generator=g) < drop] = -100
    if rank == 1 and cell.get("empty_rank1"):
        labels[:] = -100
    return ids, labels


def count_head_gathers(model):
    """Count the gathers of the head (weight and bias) by phase, at DeepSpeed's two entry points: a
    parameter's ``all_gather`` (GatheredParameters, the attribute getter) and ``all_gather_coalesced``
    (the module hooks' fetch). Only parameters DeepSpeed reports NOT_AVAILABLE are counted: a call for an
    already whole parameter gathers nothing."""
    head = {id(model.lm_head.weight)}

    def wrap(param, attr):
        original = getattr(param, attr)

        def counted(*args, **kwargs):
            params = kwargs.get("param_list") or (args[0] if args else None)
            params = [param] if params is None else list(params)
            if any(id(p) in head and p.ds_status.name == "NOT_AVAILABLE" for p in params):
                COUNTS[_PHASE[0]] += 1
            return original(*args, **kwargs)

        setattr(param, attr, counted)

    for p in model.parameters():
        wrap(p, "all_gather")
        wrap(p, "all_gather_coalesced")


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 2500,
                              "allgather_bucket_size": 2500},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def full_parameters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in engine.module.named_parameters()}


def run_cell(cell: dict, init_state: dict, rank: int) -> dict:
    import deepspeed

    model = HeadModel(cell)
    model.load_state_dict(init_state, strict=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=ds_config())
    count_head_gathers(engine.module)
    api = gathered_api(engine.module) if cell.get("api_check") else None
    snapshots, gathers, losses = [], [], []
    for step in range(STEPS):
        for key in COUNTS:
            COUNTS[key] = 0
        ids, labels = batch(step, rank, cell)
        if cell["mode"] == "inside":
            loss = engine(ids, labels)
        else:
            hidden = engine(ids) if cell["mode"] == "outside" else engine.module.decoder(ids)
            loss = head_loss(engine.module, hidden, labels, cell)
        losses.append(float(loss))
        with phase("backward"):
            engine.backward(loss)
        with torch.no_grad():
            engine.step()
        gathers.append(dict(COUNTS))
        snapshots.append(full_parameters(engine))
    return {"snapshots": snapshots, "gathers": gathers, "losses": losses, "api": api}


def gathered_api(model) -> dict:
    """``zerofix.gathered`` on its own: duplicates (by identity, also inside lists) gathered once, the
    parameter whole inside and partitioned after, a nested block on a whole parameter a no-op."""
    import zerofix

    w, b = model.lm_head.weight, model.lm_head.bias
    out = {"numel_before": w.numel()}
    with phase("api"):
        with zerofix.gathered(w, w, [w, b], None):
            out["shape_inside"] = list(w.shape)
            out["gathers_outer"] = COUNTS["api"]
            with zerofix.gathered(w):
                out["gathers_nested"] = COUNTS["api"] - out["gathers_outer"]
            out["whole_after_nested"] = w.numel()
    out["numel_after"] = w.numel()
    out["status_after"] = w.ds_status.name
    return out


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True, help="JSON file: a list of cell dicts")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = json.loads(Path(args.cells).read_text())
    torch.manual_seed(0)
    init_state = HeadModel({"bias": True, "tied": False}).state_dict()
    if rank == 0:
        torch.save(init_state, out / "init.pt")
    record = {"rank": rank, "world": dist.get_world_size(), "cells": {}}
    for cell in cells:
        try:
            result = run_cell(cell, init_state, rank)
        except Exception as exc:  # noqa: BLE001 - a crash is a result (the naive loss under ZeRO-3)
            result = {"snapshots": [], "gathers": [], "losses": [], "error": f"{type(exc).__name__}: {exc}"}
        if rank == 0:
            torch.save(result["snapshots"], out / f"{cell['name']}.pt")
        result.pop("snapshots")
        record["cells"][cell["name"]] = result
        collect_and_freeze()  # see ds_accumulation: the next cell's collections skip what this one left
        dist.barrier()
    write_whole(out / f"rank{rank}.json", json.dumps(record, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zerofix.check.rank import entry

    entry(run)
