"""Peak memory and time of one forward+backward of an LM-head cross-entropy, CPU, side by side.

    python benchmarks/bench_chunked_ce.py            # N=8192, H=1024, V=32000, float32 (the issue's size)
    python benchmarks/bench_chunked_ce.py --quick    # N=2048, H=512, V=8000

Variants (each run in a fresh process, ``--repeats`` times, medians reported):
- ``plain``: ``F.cross_entropy(h @ W.T, y)``, the full N x V logits;
- ``trl``: the installed TRL's chunked loss: ``_chunked_cross_entropy_loss`` (chunked_nll, 1.4-1.5) or
  ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` with TRL's chunk size (what ``nll`` uses in 1.16);
- ``liger``: Liger-Kernel's PyTorch fallback fused linear cross-entropy, when ``--liger PATH`` points at an
  installed ``liger_kernel`` (its package import needs Triton, which has no CPU build, so the fallback's
  own module file is loaded; it imports only torch);
- ``zerofix``: ``zerofix.chunked_cross_entropy``.

Peak memory is the growth of the process's peak RSS during the measured call, after the inputs exist (so
the two gradients, 157 MiB at the full size, are part of every variant's figure). Time is the wall time
of that call, after a small warm-up. 10% of the labels are ignore_index. Every variant's loss and weight
gradient are checked against plain's before timing (relative error printed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"full": (8192, 1024, 32000), "quick": (2048, 512, 8000)}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def loss_fn(variant: str, liger_path: str | None):
    import torch
    import torch.nn.functional as F

    if variant == "plain":
        return lambda h, w, y: F.cross_entropy(h @ w.t(), y, ignore_index=-100), "F.cross_entropy(h @ W.T)"
    if variant == "zerofix":
        import zerofix

        return lambda h, w, y: zerofix.chunked_cross_entropy(h, w, y), f"zerofix {zerofix.__version__}"
    if variant == "trl":
        import trl

        try:
            from trl.trainer.sft_trainer import _CHUNKED_LM_HEAD_CHUNK_SIZE, _chunked_cross_entropy_loss
        except ImportError:
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
            from trl.trainer import utils

            chunk = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 4096)

            def chunked_logprob(h, w, y):
                mask = y != -100
                logp = ChunkedLogProbFunction.apply(h[mask], w, None, y[mask], 1.0, chunk, None, 1.0, ())[0]
                return -logp.sum() / mask.sum().clamp(min=1)

            return chunked_logprob, f"trl {trl.__version__} ChunkedLogProbFunction (chunk {chunk})"

        def chunked_nll(h, w, y):
            # shift_labels: no internal shift, the same tokens as the other variants
            return _chunked_cross_entropy_loss(h, w, _CHUNKED_LM_HEAD_CHUNK_SIZE, shift_labels=y)[0]

        return chunked_nll, f"trl {trl.__version__} _chunked_cross_entropy_loss (chunk {_CHUNKED_LM_HEAD_CHUNK_SIZE})"
    if variant == "liger":
        path = Path(liger_path) / "liger_kernel" / "ops" / "fused_linear_scaled_cross_entropy.py"
        spec = importlib.util.spec_from_file_location("liger_fallback", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        version = next(Path(liger_path).glob("liger_kernel-*.dist-info")).name.split("-")[1].removesuffix(".dist")

        def liger(h, w, y):
            nll = module.LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, y, 1.0, -100)
            mask = y != -100
            return nll.sum() / mask.sum().clamp(min=1)

        del torch
        return liger, f"liger-kernel {version} PyTorch fallback (chunk {module._FALLBACK_CHUNK_SIZE})"
    raise ValueError(variant)


def inputs(n, h, v, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, weight, labels


def child(variant: str, size: str, liger_path: str | None) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    fn, label = loss_fn(variant, liger_path)
    n, hdim, v = SIZES[size]
    # warm-up: a small problem, so one-time costs (kernels, allocator pools) are not timed
    wh, ww, wy = inputs(256, hdim, 1024, seed=1)
    fn(wh, ww, wy).backward()
    del wh, ww, wy
    hidden, weight, labels = inputs(n, hdim, v)
    base = rss_mib()
    start = time.perf_counter()
    loss = fn(hidden, weight, labels)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = peak_mib() - base
    # correctness against the full logits, after the measurement (it would dominate the peak otherwise)
    gw = weight.grad.clone()
    weight.grad = None
    ref = torch.nn.functional.cross_entropy(hidden.detach() @ weight.t(), labels, ignore_index=-100)
    ref.backward()
    rel_w = float((gw - weight.grad).norm() / weight.grad.norm())
    return {"variant": variant, "label": label, "seconds": seconds, "peak_mib": peak,
            "loss_rel_err": abs(float(loss) - float(ref)) / abs(float(ref)), "grad_w_rel_err": rel_w}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="plain,trl,liger,zerofix")
    parser.add_argument("--liger", default=None, help="directory holding an installed liger_kernel "
                        "(pip install --no-deps --target DIR liger-kernel)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    if args.child:
        print(json.dumps(child(args.child, size, args.liger)))
        return
    variants = [v for v in args.variants.split(",") if v != "liger" or args.liger]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # interleaved, so a slow phase of the machine hits every variant
        for variant in variants:
            cmd = [sys.executable, __file__, "--child", variant] + (["--quick"] if args.quick else [])
            cmd += ["--liger", args.liger] if args.liger else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    n, h, v = SIZES[size]
    print(f"LM-head cross-entropy, N={n} H={h} V={v} float32, CPU, {os.environ.get('OMP_NUM_THREADS', 2)} "
          f"threads; one forward+backward per process, median of {args.repeats} processes")
    plain = runs.get("plain")
    med = {k: {m: statistics.median(r[m] for r in rs) for m in ("seconds", "peak_mib")} for k, rs in runs.items()}
    print(f"{'variant':<9} {'peak MiB':>9} {'x plain':>8} {'seconds':>8} {'x plain':>8} {'loss err':>9} "
          f"{'dW err':>8}  implementation")
    for k, rs in runs.items():
        mem_ratio = med[k]["peak_mib"] / med["plain"]["peak_mib"] if plain else float("nan")
        time_ratio = med[k]["seconds"] / med["plain"]["seconds"] if plain else float("nan")
        print(f"{k:<9} {med[k]['peak_mib']:>9.0f} {mem_ratio:>8.3f} {med[k]['seconds']:>8.2f} {time_ratio:>8.3f} "
              f"{max(r['loss_rel_err'] for r in rs):>9.1e} {max(r['grad_w_rel_err'] for r in rs):>8.1e}  "
              f"{rs[0]['label']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": SIZES[size], "runs": runs, "medians": med}, indent=1))


if __name__ == "__main__":
    main()
