"""Demo of the foundation fix: the Trainer's gradient-accumulation update, unpatched and patched,
against the reference computed by hand in one process (becomes ``zerofix check``)."""
from __future__ import annotations

import sys
import tempfile
import time
from importlib import metadata

from zerofix.check import parity


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


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
    print(f"\npatched worst rel.err {worst:.1e} ({'ok' if worst < 1e-6 else 'WRONG'}); {time.time() - start:.0f} s")
    return 0 if worst < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
