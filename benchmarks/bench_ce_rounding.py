"""How far an LM-head cross-entropy's bf16 weight gradient lies from float64, each loss with its own settings.

    python benchmarks/bench_ce_rounding.py [--n 4096 --h 1024 --v 32000] [--json PATH]

The reference is the fair one for low precision (tests/test_losses_blocked.py): the inputs rounded to bf16, the head's
product rounded to bf16 once (as the model's own head gives it), everything else in float64. Each variant's weight
gradient is compared with it, relative max error and relative Frobenius error, and each error is also given as a
multiple of plain autograd's (``F.cross_entropy((h @ W.T).float(), y)`` in bf16: one GEMM's float32 sum rounded once per
element):

- ``zerofix``: ``zerofix.chunked_cross_entropy`` with its defaults (the blocked path);
- ``liger-own-chunks``: Liger-Kernel's way of building dW, emulated on CPU with Liger's own chunk rule: chunks of
  ``next_power_of_2(ceil(N / ceil(V / H)))`` rows (128 rows, 32 chunks at 4096 x 1024 x 32000), each chunk's product
  added into a bf16 gradient (``torch.addmm(grad_weight, grad_logits.t(), input_chunk, out=grad_weight)``, Liger's
  default ``accum_dtype``: the weight's). Liger's Triton kernel itself has no CPU build; the emulation takes its
  chunking and its accumulation, which is what decides the rounding;
- ``liger-8-row-chunks``: the same accumulation over 8-row chunks (512 chunks at N=4096), the setting behind the
  "13x" of tests/test_losses_blocked.py's small case: not Liger's own setting.

Issue 58, item 4: every comparison with a peer is measured with the peer's own settings, and the docs say which.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def liger_chunk_rows(n: int, h: int, v: int) -> int:
    """Liger-Kernel's fused linear cross-entropy chunk size (``fused_linear_cross_entropy_forward``)."""
    inc_factor = math.ceil(v / h)
    return 1 << max(0, math.ceil(math.log2(math.ceil(n / inc_factor))))


def errors(got, ref) -> dict:
    diff = (got.double() - ref).abs()
    return {"max": float(diff.max() / ref.abs().max()), "fro": float(diff.norm() / ref.norm())}


def main() -> None:
    import torch
    import torch.nn.functional as F

    from zerofix import chunked_cross_entropy

    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n, h, v = args.n, args.h, args.v
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    counted = labels != -100
    count = int(counted.sum())
    start = time.perf_counter()

    # the reference: bf16 inputs, the product rounded once to bf16, the rest float64
    with torch.no_grad():
        z = (hidden @ weight.t()).double()  # bf16 GEMM: the model's own rounded logits
        d = torch.softmax(z, -1)
        d[counted, labels[counted]] -= 1
        d[~counted] = 0
        d /= count
        ref = d.t() @ hidden.double()
    rows = {}

    wb = weight.clone().requires_grad_()
    F.cross_entropy((hidden @ wb.t()).float(), labels, ignore_index=-100).backward()
    rows["plain"] = errors(wb.grad, ref)

    wb = weight.clone().requires_grad_()
    chunked_cross_entropy(hidden, wb, labels).backward()
    rows["zerofix"] = errors(wb.grad, ref)

    for name, chunk in (("liger-own-chunks", liger_chunk_rows(n, h, v)), ("liger-8-row-chunks", 8)):
        acc = torch.zeros_like(weight)
        with torch.no_grad():
            for s in range(0, n, chunk):
                zc = (hidden[s:s + chunk] @ weight.t()).float()
                y = labels[s:s + chunk]
                dc = torch.where((y != -100)[:, None], zc.softmax(-1) - F.one_hot(y.clamp(min=0), v), 0.0) / count
                acc.addmm_(dc.bfloat16().t(), hidden[s:s + chunk])
        rows[name] = {**errors(acc, ref), "chunk_rows": chunk, "chunks": math.ceil(n / chunk)}
    plain = rows["plain"]
    print(f"bf16 weight gradient against float64 (bf16 inputs, product rounded once), N={n} H={h} V={v}, 10% ignored; "
          f"{time.perf_counter() - start:.0f} s")
    print(f"{'variant':<20} {'max rel':>9} {'x plain':>8} {'Frobenius':>10} {'x plain':>8}  settings")
    for name, r in rows.items():
        r["max_x_plain"], r["fro_x_plain"] = r["max"] / plain["max"], r["fro"] / plain["fro"]
        setting = f"{r['chunks']} chunks of {r['chunk_rows']} rows" if "chunks" in r else "defaults"
        print(f"{name:<20} {r['max']:>9.2e} {r['max_x_plain']:>8.2f} {r['fro']:>10.2e} {r['fro_x_plain']:>8.2f}  "
              f"{setting}")
    if args.json:
        Path(args.json).write_text(json.dumps({"n": n, "h": h, "v": v, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
