"""The bytes an LM-head cross-entropy keeps alive, at the GPU table's bf16 sizes, counted on this machine.

    python benchmarks/bench_ce_bytes.py [--json PATH]

One forward+backward of each loss on ``meta`` tensors (shapes, no values: nothing is allocated or computed) under
``live_bytes.LiveBytes``, a tensor accountant: the peak of live storage over the inputs, both gradients included --
the figure ``torch.cuda.max_memory_allocated`` growth gives on a GPU (``bench_chunked_ce.py --device cuda``). The
plain loss's count equals its H100 measurement to the MiB, which is what makes the others' counts mean something.
Liger-Kernel and cut-cross-entropy are Triton kernels that do not run here; their columns are their H100
measurements (docs/measured/gpu-h100-2026-11-27-issue51/bench.txt), the figures to be at or below.

zerofix is counted with its defaults, with softcap + label smoothing + z-loss (one more float32 piece), with the
statistics the Trainer logs (three more), and with a bias.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_bytes import LiveBytes  # noqa: E402

MIB = 2**20
# (N, H, V) and the H100's bf16 figures (MiB, max_memory_allocated growth): plain, zerofix before issue 52, Liger, cce
GPU_ROWS = (
    ((8192, 4096, 128256), {"plain": 12024, "zerofix 0.x (fp32 dW buffer)": 4624, "liger": 1129, "cce": 1068}),
    ((32768, 4096, 151936), {"plain": 56976, "zerofix 0.x (fp32 dW buffer)": 4319, "liger": 1740, "cce": 1445}),
    ((8192, 4096, 32000), {"plain": 3000, "zerofix 0.x (fp32 dW buffer)": 2021, "liger": 377, "cce": 314}),
)


def variants() -> dict:
    import torch
    import torch.nn.functional as F

    from zerofix.losses import chunked_cross_entropy, chunked_cross_entropy_with_stats

    return {
        "plain": lambda h, w, y, b: F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100),
        "zerofix": lambda h, w, y, b: chunked_cross_entropy(h, w, y),
        "zerofix softcap+ls+z": lambda h, w, y, b: chunked_cross_entropy(h, w, y, logit_softcap=30.0,
                                                                          label_smoothing=0.1, z_loss=1e-4),
        "zerofix stats": lambda h, w, y, b: chunked_cross_entropy_with_stats(h, w, y)[0],
        "zerofix bias": lambda h, w, y, b: chunked_cross_entropy(h, w, y, b),
        # issue 70: the three-GEMM path a GPU takes by default (its kernel accounted, not run: meta tensors), and its
        # accurate policy (a float32 weight-gradient buffer: above Liger's bytes by design)
        "zerofix fused": fused(lambda h, w, y, b: chunked_cross_entropy(h, w, y)),
        "zerofix fused accurate": fused(lambda h, w, y, b: chunked_cross_entropy(h, w, y, accuracy="accurate")),
        "_torch": torch,
    }


def fused(loss):
    """``loss`` on the fused path (what CUDA takes where Triton imports), here on meta tensors."""
    from zerofix.losses import function

    def run(*args):
        chosen = function.choose_path
        function.choose_path = lambda *a: "fused" if chosen(*a) == "blocked" else chosen(*a)
        try:
            return loss(*args)
        finally:
            function.choose_path = chosen
    return run


def count(fn, n: int, hdim: int, v: int) -> dict:
    """Peak and end-of-backward live bytes (MiB) of one forward+backward on meta tensors, bf16."""
    import torch

    h = torch.empty(n, hdim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(v, hdim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(v, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = torch.empty(n, device="meta", dtype=torch.long)
    start = time.perf_counter()
    with LiveBytes() as acct:
        fn(h, w, y, b).backward()
        end = acct.now
    return {"peak_mib": acct.peak / MIB, "end_mib": end / MIB, "peak_at": acct.peak_at,
            "seconds": time.perf_counter() - start}


def table() -> list[dict]:
    fns = variants()
    fns.pop("_torch")
    rows = []
    for (n, hdim, v), gpu in GPU_ROWS:
        for name, fn in fns.items():
            rows.append({"n": n, "h": hdim, "v": v, "variant": name, **count(fn, n, hdim, v),
                         "gpu_mib": gpu.get(name), "liger_mib": gpu["liger"], "cce_mib": gpu["cce"],
                         "before_mib": gpu["zerofix 0.x (fp32 dW buffer)"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    import torch

    import zerofix

    rows = table()
    print(f"live bytes of one LM-head cross-entropy forward+backward, bf16, counted on meta tensors (torch "
          f"{torch.__version__}, zerofix {zerofix.__version__}); MiB over the inputs, both gradients included")
    print(f"{'N, H, V':<20} {'variant':<21} {'counted':>8} {'H100':>7} {'Liger':>6} {'cce':>6} {'x Liger':>8}")
    for r in rows:
        where = f"{r['n']}, {r['h']}, {r['v']}"
        gpu = "" if r["gpu_mib"] is None else f"{r['gpu_mib']:.0f}"
        print(f"{where:<20} {r['variant']:<21} {r['peak_mib']:>8.0f} {gpu:>7} {r['liger_mib']:>6} {r['cce_mib']:>6} "
              f"{r['peak_mib'] / r['liger_mib']:>8.3f}")
    print("H100: the same loss measured there (max_memory_allocated growth); zerofix before the blocked path: "
          + " / ".join(str(gpu["zerofix 0.x (fp32 dW buffer)"]) for _, gpu in GPU_ROWS) + " MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
