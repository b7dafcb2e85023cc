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

from zerofix.check.files import write_whole
from zerofix.check import accumulation, models, reference
from zerofix.check.host import collectives
from zerofix.check.session import collect_and_freeze, freeze_once

FIX = "deepspeed-manual-accumulation"  # the fix whose per-engine runtime the results carry


def ds_config(cell: accumulation.Cell, base: dict | None = None) -> dict:
    """The cell's DeepSpeed configuration; ``base``: a user's resolved configuration (``zerofix check
    --deepspeed``), of which the cell sets only the micro-batch, the config GAS and the clipping."""
    if base is not None:
        return {**base, "train_micro_batch_size_per_gpu": accumulation.MICRO_BATCH,
                "gradient_accumulation_steps": cell.gas, "gradient_clipping": cell.clip}
    return {
        "train_micro_batch_size_per_gpu": accumulation.MICRO_BATCH,
        "gradient_accumulation_steps": cell.gas,
        "gradient_clipping": cell.clip,  # set even when 0: DeepSpeed >= 0.19 defaults it to 1.0
        "zero_optimization": {
            "stage": cell.stage, "overlap_comm": cell.overlap_comm, "contiguous_gradients": True,
            # several buckets per backward, and tiny parameters really partitioned under ZeRO-3
            "reduce_bucket_size": 2500, "allgather_bucket_size": 2500,
            "stage3_param_persistence_threshold": 0,
            **({"offload_optimizer": {"device": "cpu"}} if cell.offload else {}),
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        # a torch optimizer on the offloaded fp32 partition (DeepSpeedCPUAdam would need a C++ build)
        **({"zero_force_ds_cpu_optimizer": False} if cell.offload else {}),
        **({"bf16": {"enabled": True}} if cell.dtype == "bf16" else {}),
        **({"data_types": {"grad_accum_dtype": "fp32"}} if cell.accum_fp32 else {}),
        **({"fp16": {"enabled": True, "initial_scale_power": 8}} if cell.dtype == "fp16" else {}),
    }


BASE_CONFIG: dict | None = None  # --base-config: a user's configuration every cell starts from


def build_engine(cell, init_state):
    import deepspeed

    # weights come from init_state or the checkpoint
    model = models.build_model("custom", seed=1, loss_only=not cell.logits)
    model.load_state_dict(init_state)
    optimizer = reference.OPTIMIZERS[cell.optimizer](model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cell, BASE_CONFIG))
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


# ----------------------------------------------------------------------------- observables (probe cells)
def digest(value) -> str:
    """Bitwise identity of a tensor (dtype, shape, bytes), or of every tensor inside a container."""
    import hashlib

    h = hashlib.sha1()

    def visit(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                visit(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        else:
            h.update(repr(v).encode() if isinstance(v, (int, float, bool, str, type(None))) else b"?")

    visit(value)
    return h.hexdigest()[:20]


class Probe:
    """What a user can observe of an engine, recorded op by op: the boundary flag before each backward,
    the value backward() returns, a full gradient read of every parameter after each backward
    (``safe_get_full_grad``, or the error it raises), micro_steps / global_steps / lr / grad norm after
    each step(), the collectives each op issued, and a checkpoint's tensors after the first window."""

    def __init__(self, engine, read_always: bool):
        self.engine = engine
        self.inside = None  # the DeepSpeed context the loop is in ("no_sync", "coalesce") or None
        # ZeRO-1/2 gradients can be read only right after a boundary backward: elsewhere DeepSpeed raises on
        # the ranks that own a fragment and all_reduces on the others, and the ranks' collectives diverge.
        # ZeRO-0/3 reads are fine at every micro-step. ``read_always``: from the second backward before a
        # step() on, where zerofix knows the loop accumulates by hand and makes every read right.
        self.anywhere = engine.zero_optimization_stage() in (0, 3)
        self.read_always = read_always
        self.since_step = 0
        self.events: list = []
        self.last_read = None  # the read after the latest backward, full tensors (the reference check)

    def collectives(self) -> list:
        return collectives.take()

    def backward(self, loss, **kwargs):
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        self.collectives()
        returned = self.engine.backward(loss, **kwargs)
        comm = self.collectives()
        self.since_step += 1
        readable = boundary or self.anywhere or (self.read_always and self.since_step >= 2)
        # inside coalesce_grad_reduction() the gradients are local until the block's flush (not a read point)
        reads = self.read() if readable and self.inside != "coalesce" else None
        self.events.append({"op": "backward", "boundary": boundary, "returned": digest(returned),
                            "reads": reads, "collectives": comm, "read_collectives": self.collectives()})

    def read(self):
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        try:
            for name, p in self.engine.module.named_parameters():
                g = safe_get_full_grad(p)
                grads[name] = None if g is None else g.detach().clone().double()
        except Exception as exc:  # noqa: BLE001 - DeepSpeed refuses some reads: that is an observable
            self.last_read = None
            return f"{type(exc).__name__}: {exc}"
        self.last_read = grads
        return digest(grads)

    def step(self):
        engine = self.engine
        self.collectives()
        self.since_step = 0
        with torch.no_grad():
            returned = engine.step()
        norm = engine.get_global_grad_norm()
        self.events.append({"op": "step", "returned": digest(returned), "micro_steps": engine.micro_steps,
                            "global_steps": engine.global_steps, "lr": digest(engine.get_lr()),
                            "norm": digest(norm), "collectives": self.collectives()})

    def other(self, op: tuple, run):
        """A context entered or left, or zero_grad(): what it returned and the collectives it issued."""
        self.collectives()
        returned = run()
        event = {"op": op[0], "returned": digest(returned), "collectives": self.collectives()}
        if op[0] == "exit" and self.inside == "coalesce":  # the block's flush reduced the window: a read point
            event.update(reads=self.read(), read_collectives=self.collectives())
        self.inside = op[1] if op[0] == "enter" else None if op[0] == "exit" else self.inside
        self.events.append(event)

    def checkpoint(self, directory: Path):
        import torch.distributed as dist

        self.engine.save_checkpoint(str(directory), tag="probe")
        dist.barrier()
        files = sorted(p for p in (directory / "probe").rglob("*.pt"))
        self.events.append({"op": "checkpoint", "files": {p.name: digest(torch.load(p, weights_only=False))
                                                          for p in files}})
        self.collectives()


def run_cell(cell, init_state, rank, world, checkpoint_dir: Path) -> dict:
    from importlib import metadata

    engine = build_engine(cell, init_state)
    # patched manual loops: zerofix makes a read after every backward right (the takeover probes)
    takes_over = _zerofix_active() and accumulation.zerofix_takes_over(cell, metadata.version("deepspeed"))
    probe = Probe(engine, read_always=takes_over) if cell.probe else None
    snapshots, norms, window_reads = [], [], []
    windows_done = 0
    contexts = []  # the DeepSpeed context managers the loop is inside
    for op in accumulation.ops(cell):
        if op[0] in ("enter", "exit", "zero_grad"):
            run = _other_op(engine, op, contexts)
            if probe is not None:
                probe.other(op, run)
            else:
                run()
            continue
        if op[0] == "backward":
            _, micro_step, divisor, explicit, share = op
            if explicit is not None:
                engine.set_gradient_accumulation_boundary(explicit)
            batch = models.collate(accumulation.sample_indices(micro_step, rank, world))
            loss = engine(**batch)["loss"] / divisor
            kwargs = {} if cell.scale_wrt_gas else {"scale_wrt_gas": False}
            part = loss if share == 1.0 else loss * share
            if cell.direct:  # torch-style: DeepSpeed's output hooks scale and its post hook reduces
                part.backward()
            elif probe is not None:
                probe.backward(part, **kwargs)
            else:
                engine.backward(part, **kwargs)
            continue
        applied_before = engine.global_steps
        if probe is not None:
            if op[1]:
                window_reads.append(probe.last_read)
            probe.step()
        elif cell.grad_step:  # as the Trainer and accelerate call it
            engine.step()
        else:  # DeepSpeed 0.18.7 - 0.18.9's ZeRO-1/2 step() raises in grad mode on gloo (accumulation.split_view_crash)
            with torch.no_grad():
                engine.step()
        if engine.global_steps != applied_before:
            norms.append(grad_norm(engine))
        if op[1]:  # the window is complete
            snapshots.append(full_parameters(engine))
            windows_done += 1
            if probe is not None and windows_done == 1:
                probe.checkpoint(checkpoint_dir)
            if cell.resume and windows_done == 1:
                engine.save_checkpoint(str(checkpoint_dir), tag="window1")
                del engine
                gc.collect()
                engine = build_engine(cell, models.build_model("custom", seed=2).state_dict())
                engine.load_checkpoint(str(checkpoint_dir), tag="window1")
    runtime = _runtime(engine)
    probe_events = probe.events if probe is not None else None
    del engine, probe
    collect_and_freeze()  # the next cell's collections (DeepSpeed 0.18.x: three per engine) skip what this one left
    result = {"snapshots": snapshots, "norms": norms, "runtime": runtime}
    if cell.probe:
        result.update(events=probe_events, window_reads=window_reads)
    return result


def _other_op(engine, op: tuple, contexts: list):
    """The call an ("enter", name) / ("exit",) / ("zero_grad",) op makes, as a function of no arguments."""
    if op[0] == "enter":
        def enter():
            context = engine.no_sync() if op[1] == "no_sync" else engine.coalesce_grad_reduction()
            contexts.append(context)
            return context.__enter__()
        return enter
    if op[0] == "exit":
        return lambda: contexts.pop().__exit__(None, None, None)
    return engine.zero_grad


def _zerofix_active() -> bool:
    from zerofix import applied

    return applied.is_applied(FIX)


def _runtime(engine) -> dict:
    """This fix's status, what it saw on this engine, and the class of the optimizer DeepSpeed built (the bf16
    entries act on one class each)."""
    import zerofix

    records = zerofix.status()
    record = next(r for r in records if r.id == FIX)
    seen = [e for e in record.runtime if e["engine"] == f"0x{id(engine):x}"]
    return {"state": record.state, "engine": seen[0] if seen else None,
            "states": {r.id: r.state for r in records}, "optimizer": type(engine.optimizer).__name__}


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True, help="JSON file: a list of Cell field dicts")
    parser.add_argument("--variants", default="unpatched,patched",
                        help="unpatched, patched, repatched (patch, unpatch, patch) and/or env")
    parser.add_argument("--fixes", default=None, help="comma-separated fix ids the patched variant enables "
                        "(default: every DeepSpeed fix of the catalogue)")
    parser.add_argument("--base-config", default=None, help="JSON file: the DeepSpeed configuration every cell "
                        "starts from (zerofix check --deepspeed)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    global BASE_CONFIG
    BASE_CONFIG = json.loads(Path(args.base_config).read_text()) if args.base_config else None
    collectives.install()
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
    freeze_once()
    if rank == 0:
        torch.save(init_state, out / "init.pt")
    record = {"rank": rank, "world": world, "cells": {}}
    for variant in args.variants.split(","):
        if variant in ("patched", "repatched"):
            import zerofix

            from zerofix import catalogue

            fixes = args.fixes.split(",") if args.fixes else [f.id for f in catalogue.FIXES if f.dist == "deepspeed"]
            zerofix.patch(fixes=fixes)
            if variant == "repatched":  # every wrapper installed, removed and installed again before training
                zerofix.unpatch(fixes)
                zerofix.patch(fixes=fixes)
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
                if "window_reads" in result:
                    torch.save(result.pop("window_reads"), out / variant / f"{cell.name}.reads.pt")
            else:
                result.pop("snapshots")
                result.pop("window_reads", None)
            results[cell.name] = result
            dist.barrier()
            if rank == 0 and checkpoint_dir.exists():
                shutil.rmtree(checkpoint_dir)
    write_whole(out / f"rank{rank}.json", json.dumps(record, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zerofix.check.rank import entry

    entry(run)
