"""Run a scenario and compare every variant's update with the single-process reference."""
from __future__ import annotations

import sys
from pathlib import Path

from zerofix.check import launch, reference

TRAINER_GAS = "zerofix.check.scenarios.trainer_gas"
LOSS_MODE = {"causal-lm": "token-mean", "custom": "batch-mean"}


def trainer_gas(out_dir, *, model: str = "causal-lm", nproc: int = 1, gas: int = 8, lr: float = 5.0,
                zerofix: str = "both", extra_args=(), env=None, launcher_prefix=(),
                python: str = sys.executable, timeout: float = 600) -> dict:
    """{variant: comparison + ``rank_status`` (per rank, fix id -> state)} for the Trainer GAS scenario."""
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
        ref = reference.reference_state(model, init, reference.windows_from_ranks(ranks),
                                        loss_mode=LOSS_MODE[model], optimizer_factory=reference.sgd(lr))
        final = torch.load(out_dir / variant / "final.pt")
        results[variant] = {**reference.compare(init, final, ref),
                            "rank_status": [{s["id"]: s["state"] for s in r["status"]} for r in ranks]}
    return results
