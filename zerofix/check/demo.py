"""Demo of the fixes on real runs: the Trainer's gradient-accumulation update and raw DeepSpeed manual
accumulation, unpatched and patched, against the reference computed by hand in one process (becomes
``zerofix check``)."""
from __future__ import annotations

import sys
import tempfile
import time
from importlib import metadata

from zerofix.check import accumulation, parity, reference

DS_CELLS = [
    accumulation.Cell(1, 1, "a"), accumulation.Cell(2, 1, "a"), accumulation.Cell(2, 1, "a", overlap_comm=True),
    accumulation.Cell(3, 1, "a"), accumulation.Cell(2, 4, "a"),
    accumulation.Cell(2, 1, "c"), accumulation.Cell(2, 4, "b"),
]
STYLE = {"a": "4 x backward, step", "b": "backward+step x 4", "c": "(a) + set_boundary(i==3)"}


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def deepspeed_manual_accumulation(tmp) -> float:
    """Raw DeepSpeed loops on 2 ranks; returns the worst patched relative error."""
    if _version("deepspeed") == "-":
        print("\n(deepspeed is not installed: no DeepSpeed rows)")
        return 0.0
    print(f"\nDeepSpeed {_version('deepspeed')}, raw loop, 2 ranks, 2 windows of 4 micro-batches "
          "(config GAS=1: the loop divides by 4; GAS=4: DeepSpeed does)")
    header = (f"{'ZeRO':<10} {'GAS':>3} {'loop (SGD)':<26}  {'unpatched':>9} {'rel.err':>8}   "
              f"{'patched':>9} {'rel.err':>8}   windows flushed")
    print(header + "\n" + "-" * len(header))
    runs = parity.ds_accumulation(f"{tmp}/deepspeed", DS_CELLS, nproc=2)
    worst = 0.0
    for cell in DS_CELLS:
        states, _ = reference.reference_windows(runs["init"], accumulation.updates(cell), world=2,
                                                optimizer_factory=reference.OPTIMIZERS[cell.optimizer])
        u, p = (reference.compare(runs["init"], runs[v][cell.name]["snapshots"][-1], states[-1])
                for v in ("unpatched", "patched"))
        worst = max(worst, p["rel_err"])
        seen = runs["patched"][cell.name]["runtime"][0]["engine"]
        zero = f"{cell.stage}{' overlap' if cell.overlap_comm else ''}"
        print(f"{zero:<10} {cell.gas:>3} {STYLE[cell.style]:<26}  {u['ratio']:>9.4f} "
              f"{u['rel_err']:>8.1e}   {p['ratio']:>9.4f} {p['rel_err']:>8.1e}   {seen['windows']:>7} "
              f"{seen['flushed']:>7}", flush=True)
    return worst


def main() -> int:
    versions = ", ".join(f"{d} {_version(d)}" for d in ("transformers", "accelerate", "torch"))
    print(f"\nTrainer, gradient_accumulation_steps=8, no DeepSpeed, SGD; {versions}")
    print("update/reference: 1.0000 is right; rel.err = max |update - reference| / max |reference|\n")
    header = f"{'model':<10} {'ranks':>5}   {'unpatched':>9} {'rel.err':>8}   {'patched':>9} {'rel.err':>8}   fix state"
    print(header + "\n" + "-" * len(header))
    worst = 0.0
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="zerofix-demo-") as tmp:
        for model in ("causal-lm", "custom"):
            for nproc in (1, 2):
                r = parity.trainer_gas(f"{tmp}/{model}-{nproc}", model=model, nproc=nproc)
                u, p = r["unpatched"], r["patched"]
                worst = max(worst, p["rel_err"])
                state = p["rank_status"][0]["transformers-accelerate-double-division"]
                print(f"{model:<10} {nproc:>5}   {u['ratio']:>9.4f} {u['rel_err']:>8.1e}   "
                      f"{p['ratio']:>9.4f} {p['rel_err']:>8.1e}   {state}", flush=True)
        worst = max(worst, deepspeed_manual_accumulation(tmp))
    print(f"\npatched worst rel.err {worst:.1e} ({'ok' if worst < 1e-6 else 'WRONG'}); {time.time() - start:.0f} s")
    return 0 if worst < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
