"""Raw DeepSpeed accumulation loops (zerofix.check.accumulation), unpatched then patched, in one job.

Run under torchrun (gloo, CPU). Every cell builds a fresh engine from the same initial weights and runs
exactly ``accumulation.ops(cell)``; after each window rank 0 stores the full parameters (gathered under
ZeRO-3) and every rank records ``engine.get_global_grad_norm()`` after each update. ``--variants``
``unpatched,patched`` runs the whole list without zerofix, then patches every DeepSpeed fix of the
catalogue (or ``--fixes``) and runs it again; ``env`` runs it once and leaves activation to the
environment (``ZEROFIX=1``, ``zerofix run``).

Writes ``init.pt``, ``<variant>/<cell>.pt`` (snapshots) and ``rank{r}.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path

import torch

from zerofix.check import accumulation, models, reference

FIX = "deepspeed-manual-accumulation"  # the fix whose per-engine runtime the results carry


def ds_config(cell: accumulation.Cell) -> dict:
    return {
        "train_micro_batch_size_per_gpu": accumulation.MICRO_BATCH,
        "gradient_accumulation_steps": cell.gas,
        "gradient_clipping": cell.clip,  # set even when 0: DeepSpeed >= 0.19 defaults it to 1.0
        "zero_optimization": {
            "stage": cell.stage, "overlap_comm": cell.overlap_comm, "contiguous_gradients": True,
            # several buckets per backward, and tiny parameters really partitioned under ZeRO-3
            "reduce_bucket_size": 2500, "allgather_bucket_size": 2500,
            "stage3_param_persistence_threshold": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def build_engine(cell, init_state):
    import deepspeed

    # weights come from init_state or the checkpoint
    model = models.build_model("custom", seed=1, loss_only=not cell.logits)
    model.load_state_dict(init_state)
    optimizer = reference.OPTIMIZERS[cell.optimizer](model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cell))
    return engine


def full_parameters(engine) -> dict:
    """Full fp32 parameters (collective under ZeRO-3). The optimizer's fp32 copy, not a
    GatheredParameters read: on 0.18.9 the embedding stays "active in submodules" after a step and
    cannot be re-partitioned when the gather context exits."""
    if engine.zero_optimization_stage() != 3:
        return {name: p.detach().clone().float() for name, p in engine.module.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().clone().float()
            for name, p in engine.module.named_parameters()}


def grad_norm(engine):
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def run_cell(cell, init_state, rank, world, checkpoint_dir: Path) -> dict:
    engine = build_engine(cell, init_state)
    snapshots, norms = [], []
    windows_done = 0
    for op in accumulation.ops(cell):
        if op[0] == "backward":
            _, micro_step, divisor, explicit = op
            if explicit is not None:
                engine.set_gradient_accumulation_boundary(explicit)
            batch = models.collate(accumulation.sample_indices(micro_step, rank, world))
            loss = engine(**batch)["loss"] / divisor
            if cell.scale_wrt_gas:
                engine.backward(loss)
            else:
                engine.backward(loss, scale_wrt_gas=False)
            continue
        applied_before = engine.global_steps
        with torch.no_grad():  # ZeRO-1/2 step() of deepspeed 0.18.x on torch 2.13 CPU needs it
            engine.step()
        if engine.global_steps != applied_before:
            norms.append(grad_norm(engine))
        if op[1]:  # the window is complete
            snapshots.append(full_parameters(engine))
            windows_done += 1
            if cell.resume and windows_done == 1:
                engine.save_checkpoint(str(checkpoint_dir), tag="window1")
                del engine
                gc.collect()
                engine = build_engine(cell, models.build_model("custom", seed=2).state_dict())
                engine.load_checkpoint(str(checkpoint_dir), tag="window1")
    runtime = _runtime(engine)
    del engine
    gc.collect()
    return {"snapshots": snapshots, "norms": norms, "runtime": runtime}


def _runtime(engine) -> dict:
    """This fix's status, and what it saw on this engine."""
    import zerofix

    records = zerofix.status()
    record = next(r for r in records if r.id == FIX)
    seen = [e for e in record.runtime if e["engine"] == f"0x{id(engine):x}"]
    return {"state": record.state, "engine": seen[0] if seen else None,
            "states": {r.id: r.state for r in records}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True, help="JSON file: a list of Cell field dicts")
    parser.add_argument("--variants", default="unpatched,patched", help="unpatched, patched and/or env")
    parser.add_argument("--fixes", default=None, help="comma-separated fix ids the patched variant enables "
                        "(default: every DeepSpeed fix of the catalogue)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [accumulation.Cell(**c) for c in json.loads(Path(args.cells).read_text())]
    init_state = models.build_model("custom", seed=0).state_dict()
    # DeepSpeed 0.18.x runs gc.collect() three times in every ZeRO-1/2 optimizer's __init__ (forced
    # memory reports, rank 0); over the ~1e6 objects torch and friends leave behind that is 1.5 s a cell.
    # Freezing what exists now keeps those collections to the cells' own objects. Numerics untouched.
    gc.freeze()
    if rank == 0:
        torch.save(init_state, out / "init.pt")
    record = {"rank": rank, "world": world, "cells": {}}
    for variant in args.variants.split(","):
        if variant == "patched":
            import zerofix

            from zerofix import catalogue

            zerofix.patch(fixes=args.fixes.split(",") if args.fixes else
                          [f.id for f in catalogue.FIXES if f.dist == "deepspeed"])
        results = record["cells"][variant] = {}
        for cell in cells:
            checkpoint_dir = out / "checkpoints" / variant / cell.name
            started = time.perf_counter()
            try:
                result = run_cell(cell, init_state, rank, world, checkpoint_dir)
            except Exception as exc:  # noqa: BLE001 - a release that raises is a result (0.18.0: TypeError)
                # Recorded, and the next cell runs: DeepSpeed raises the same way on every rank here.
                result = {"snapshots": [], "norms": [], "runtime": None, "error": f"{type(exc).__name__}: {exc}"}
                gc.collect()
            result["seconds"] = round(time.perf_counter() - started, 3)
            if rank == 0:
                (out / variant).mkdir(parents=True, exist_ok=True)
                torch.save(result.pop("snapshots"), out / variant / f"{cell.name}.pt")
            else:
                result.pop("snapshots")
            results[cell.name] = result
            dist.barrier()
            if rank == 0 and checkpoint_dir.exists():
                shutil.rmtree(checkpoint_dir)
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    from zerofix.check.scenarios import finish

    finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
