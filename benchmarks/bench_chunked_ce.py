"""Peak memory and time of one forward+backward of an LM-head cross-entropy, CPU, side by side.

    python benchmarks/bench_chunked_ce.py            # N=8192, H=1024, V=32000, float32 (the issue's size)
    python benchmarks/bench_chunked_ce.py --quick    # N=2048, H=512, V=8000
    python benchmarks/bench_chunked_ce.py --device cuda   # the GPU table (issue 41): see cuda_table()

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
    if variant == "torch":  # torch's own, with its chunked path (LinearCrossEntropyOptions: its "auto" choices)
        options = torch.nn.LinearCrossEntropyOptions()
        return (lambda h, w, y: F.linear_cross_entropy(h, w, y, ignore_index=-100, options=options),
                f"torch {torch.__version__} F.linear_cross_entropy(options=LinearCrossEntropyOptions())")
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


# The GPU table's sizes (issue 41): the H200 measurement's four rows.
CUDA_SIZES = ((8192, 4096, 128256, "bf16"), (32768, 4096, 151936, "bf16"), (8192, 4096, 32000, "bf16"),
              (8192, 4096, 128256, "fp32"))


def cuda_variants() -> dict:
    """plain, zerofix, and Liger-Kernel's Triton fused linear cross-entropy and cut-cross-entropy where installed:
    name -> f(hidden, weight, labels) returning the mean loss over the counted tokens."""
    import torch.nn.functional as F

    import zerofix

    import torch

    out = {"plain": lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100),
           # issue 70: the three-GEMM path with the fused kernel, both accuracy policies (compact: the default), and
           # the blocked path it replaced on CUDA (four GEMMs), forced
           "zerofix": lambda h, w, y: zerofix.chunked_cross_entropy(h, w, y),
           "zf-accurate": lambda h, w, y: zerofix.chunked_cross_entropy(h, w, y, accuracy="accurate"),
           "zf-blocked": blocked_path(zerofix.chunked_cross_entropy)}
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch >= 2.13
        options = torch.nn.LinearCrossEntropyOptions()
        out["torch"] = lambda h, w, y: F.linear_cross_entropy(h, w, y, ignore_index=-100, options=options)
        for policy in ("accurate", "compact"):  # torch 2.14+: the same trade, named (issue 70)
            try:
                named = torch.nn.LinearCrossEntropyOptions(acc_policy=policy)
            except TypeError:
                break
            out[f"torch-{policy}"] = (lambda o: lambda h, w, y: F.linear_cross_entropy(h, w, y, ignore_index=-100,
                                                                                       options=o))(named)
    if importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        out["liger"] = lambda h, w, y: liger(w, h, y)
    if importlib.util.find_spec("cut_cross_entropy") is not None:
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=-100)
    return out


def blocked_path(loss):
    """``loss`` run on the blocked path (four GEMMs, no fused kernel) wherever the fused one would run."""
    from zerofix.losses import function

    def run(h, w, y):
        chosen = function.choose_path
        function.choose_path = lambda *a: "blocked" if chosen(*a) == "fused" else chosen(*a)
        try:
            return loss(h, w, y)
        finally:
            function.choose_path = chosen
    return run


def cuda_inputs(n, hdim, v, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, hdim, generator=g, device="cuda") * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, hdim, generator=g, device="cuda") / hdim**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device="cuda")
    labels[torch.rand(n, generator=g, device="cuda") < 0.1] = -100
    return hidden, weight, labels


def cuda_measure(fn, hidden, weight, labels, repeats: int = 10, warmup: int = 3) -> dict:
    """Median forward+backward time (CUDA events) and the peak allocated over the inputs (both gradients in)."""
    import torch

    times = []
    for i in range(warmup + repeats):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(hidden, weight, labels).backward()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"ms": statistics.median(times), "peak_mib": peak}


def cuda_parity(fn, dtype) -> tuple[float, float]:
    """Relative errors of the loss and of the weight's gradient (Frobenius) against float64 from the same rounded
    inputs, at N=8192, H=512, V=32000 (several chunks, so the weight gradient's accumulation shows; issue 70)."""
    import torch
    import torch.nn.functional as F

    hidden, weight, labels = cuda_inputs(8192, 512, 32000, dtype, seed=3)
    loss = fn(hidden, weight, labels)
    loss.backward()
    w64 = weight.detach().double().requires_grad_()
    ref = F.cross_entropy(hidden.detach().double() @ w64.t(), labels, ignore_index=-100)
    ref.backward()
    grad = float((weight.grad.double() - w64.grad).norm() / w64.grad.norm())
    return abs(float(loss.double()) - float(ref)) / abs(float(ref)), grad


def cuda_table(repeats: int, json_path: str | None) -> None:
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    variants = cuda_variants()
    print(f"LM-head cross-entropy forward+backward on {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"CUDA events, median of {repeats} after 3 warm-ups; peak = max_memory_allocated growth over the inputs")
    rows = []
    for n, hdim, v, dt in CUDA_SIZES:
        hidden, weight, labels = cuda_inputs(n, hdim, v, dtypes[dt])
        for name, fn in variants.items():
            try:
                result = cuda_measure(fn, hidden, weight, labels, repeats)
                result["parity"], result["dw_parity"] = cuda_parity(fn, dtypes[dt])
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run this size says why
                result = {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
            rows.append({"n": n, "h": hdim, "v": v, "dtype": dt, "variant": name, **result})
        del hidden, weight, labels
        torch.cuda.empty_cache()
    print(f"{'N, H, V, dtype':<26} {'variant':<14} {'ms':>8} {'peak MiB':>9} {'loss rel err (f64)':>19} "
          f"{'dW rel err (f64)':>17}")
    for r in rows:
        where = f"{r['n']}, {r['h']}, {r['v']}, {r['dtype']}"
        if "error" in r:
            print(f"{where:<26} {r['variant']:<14} {r['error']}")
        else:
            print(f"{where:<26} {r['variant']:<14} {r['ms']:>8.1f} {r['peak_mib']:>9.0f} {r['parity']:>19.1e} "
                  f"{r['dw_parity']:>17.1e}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


# The chunk-size sweep on a GPU (--sweep): the two large-vocabulary rows of the table
SWEEP_SIZES = ((32768, 4096, 151936), (8192, 4096, 128256))
SWEEP_CHUNKS = (128, 256, 512, 1024, 2048, 4096)


def cuda_sweep(json_path: str | None) -> None:
    """zerofix's time and peak per chunk size, bf16 (what ``default_chunk_size(V, "cuda")`` is chosen from)."""
    import torch

    import zerofix
    from zerofix.losses import default_chunk_size

    print(f"chunk-size sweep on {torch.cuda.get_device_name(0)}: zerofix forward+backward, bf16, median of 3")
    rows = []
    for n, hdim, v in SWEEP_SIZES:
        hidden, weight, labels = cuda_inputs(n, hdim, v, torch.bfloat16)
        for chunk in SWEEP_CHUNKS:
            r = cuda_measure(lambda h, w, y: zerofix.chunked_cross_entropy(h, w, y, chunk_size=chunk),
                             hidden, weight, labels, repeats=3, warmup=1)
            rows.append({"n": n, "h": hdim, "v": v, "chunk": chunk, **r})
            mark = " (default)" if chunk == default_chunk_size(v, "cuda") else ""
            print(f"N={n} V={v} chunk={chunk:<5} {r['ms']:8.1f} ms {r['peak_mib']:8.0f} MiB{mark}", flush=True)
        del hidden, weight, labels
        torch.cuda.empty_cache()
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: plain, zerofix, Liger-Kernel and cut-cross-entropy in one process (cuda_table)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="with --device cuda: zerofix's chunk sizes (cuda_sweep)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="plain,trl,liger,torch,zerofix")
    parser.add_argument("--liger", default=None, help="directory holding an installed liger_kernel "
                        "(pip install --no-deps --target DIR liger-kernel)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_chunked_ce: --device cuda needs a CUDA device; the GPU figures are measured on a GPU "
                     "machine only (docs/benchmarks.md)")
        if args.sweep:
            cuda_sweep(args.json)
        else:
            cuda_table(10 if args.repeats == 3 else args.repeats, args.json)
        return
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
