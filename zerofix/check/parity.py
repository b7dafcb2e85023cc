"""Run a scenario and compare every variant's update with the single-process reference."""
from __future__ import annotations

import sys
from pathlib import Path

from zerofix.check import launch, reference

TRAINER_GAS = "zerofix.check.scenarios.trainer_gas"
LOSS_MODE = {"causal-lm": "token-mean", "custom": "batch-mean"}


def trainer_gas(out_dir, *, model: str = "causal-lm", nproc: int = 1, gas: int = 8, lr: float = 5.0,
                zerofix: str = "both", extra_args=(), env=None, launcher_prefix=(),
                python: str = sys.executable, timeout: float = 600, also_last: bool = False) -> dict:
    """{variant: comparison + ``rank_status`` (per rank, fix id -> state)} for the Trainer GAS scenario.
    ``also_last``: each variant also carries ``vs_last``, its comparison with a run that keeps only
    each rank's last micro-batch of every window (how a broken accumulator behaves)."""
    import torch

    out_dir = Path(out_dir)
    args = ["--model", model, "--gas", str(gas), "--lr", str(lr), "--zerofix", zerofix, *extra_args]
    records = launch.torchrun(TRAINER_GAS, args, nproc=nproc, out_dir=out_dir, env=env,
                              launcher_prefix=launcher_prefix, python=python, timeout=timeout)
    init = torch.load(out_dir / "init.pt")
    results = {}
    for variant in sorted({r["variant"] for r in records}):
        ranks = sorted((r for r in records if r["variant"] == variant), key=lambda r: r["rank"])
        if len(ranks) != nproc:
            raise launch.LaunchError(f"{variant}: {len(ranks)} of {nproc} ranks reported")
        windows = reference.windows_from_ranks(ranks)
        ref = reference.reference_state(model, init, windows, loss_mode=LOSS_MODE[model],
                                        optimizer_factory=reference.sgd(lr))
        final = torch.load(out_dir / variant / "final.pt")
        comparison = reference.compare(init, final, ref)
        if also_last:
            last = reference.reference_state(model, init, windows, loss_mode=LOSS_MODE[model],
                                             optimizer_factory=reference.sgd(lr), last_of_each=nproc)
            comparison["vs_last"] = reference.compare(init, final, last)
        results[variant] = {**comparison,
                            "rank_status": [{s["id"]: s["state"] for s in r["status"]} for r in ranks],
                            "rank_runtime": [{s["id"]: s.get("runtime", ()) for s in r["status"]} for r in ranks]}
    return results


DS_ACCUMULATION = "zerofix.check.scenarios.ds_accumulation"


def ds_accumulation(out_dir, cells, *, nproc: int = 2, variants=("unpatched", "patched"), fixes=None, env=None,
                    python: str = sys.executable, timeout: float = 900) -> dict:
    """Run the raw DeepSpeed loops; {variant: {cell name: {"snapshots", "norms" (per rank), "runtime"}}}
    plus "init" (initial weights) and "world"."""
    import json

    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells_file = out_dir / "cells.json"
    cells_file.write_text(json.dumps([c._asdict() for c in cells]))
    args = ["--cells", str(cells_file), "--variants", ",".join(variants)]
    if fixes is not None:
        args += ["--fixes", ",".join(fixes)]
    records = launch.torchrun(DS_ACCUMULATION, args, nproc=nproc, out_dir=out_dir, env=env, python=python,
                              timeout=timeout)
    if len(records) != nproc:
        raise launch.LaunchError(f"{len(records)} of {nproc} ranks reported")
    results = {"init": torch.load(out_dir / "init.pt"), "world": nproc}
    for variant in variants:
        results[variant] = {
            cell.name: {
                "snapshots": torch.load(out_dir / variant / f"{cell.name}.pt"),
                "norms": [r["cells"][variant][cell.name]["norms"] for r in records],
                "runtime": [r["cells"][variant][cell.name]["runtime"] for r in records],
                "errors": [r["cells"][variant][cell.name].get("error") for r in records],
            }
            for cell in cells
        }
    return results


def window_errors(init: dict, snapshots: list[dict], references: list[dict]) -> list[float]:
    """Per window, max |measured update - reference update| / max |reference update| (the absolute
    error when the reference update is zero, i.e. DeepSpeed was expected not to step)."""
    import torch

    errors = []
    for measured, ref in zip(snapshots, references, strict=True):
        du = torch.cat([(measured[k].double() - init[k].double()).flatten() for k in sorted(ref)])
        dr = torch.cat([(ref[k].double() - init[k].double()).flatten() for k in sorted(ref)])
        scale = dr.abs().max().item()
        errors.append((du - dr).abs().max().item() / (scale if scale > 0 else 1.0))
    return errors
