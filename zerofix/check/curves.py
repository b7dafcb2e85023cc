"""``zerofix check --plot``: for the scenarios whose runs were wrong, the loss over 20 optimizer steps,
unpatched vs patched vs the single-process reference, so the divergence is seen, not just read.

Each plotted scenario is trained again for 20 steps on one repeated window of samples (so the loss can
fall), unpatched and patched in one launch; the curve is the window's loss (float64, the loss the user
means) at the weights before each step and after the last. The reference trains the same window from
the same initial weights in one process.
"""
from __future__ import annotations

import math
from pathlib import Path

STEPS = 20
# SGD learning rates whose reference curve falls steadily over STEPS; the Llama diverges at the check's 5.0.
CURVE_LR = {"causal-lm": 0.5, "custom": 5.0}
PLOTTABLE = ("trainer-", "accelerate-", "deepspeed")  # jobs whose curves can be re-run (by job name prefix)


def unavailable() -> str | None:
    """Why --plot cannot work here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed here: pip install matplotlib"
    return None


def wanted(results: list[dict]) -> list[dict]:
    """The rows with a bug: wrong unpatched or wrong patched (ok and skipped rows are not plotted)."""
    return [r for r in results if r["status"] in ("fixed", "WRONG")]


def plot(results: list[dict], path, *, nproc: int, timeout: float, workdir=None) -> tuple[str, list[dict]]:
    """Run the curves and write the figure; returns (what to print, the curves)."""
    import tempfile

    rows = wanted(results)
    if not rows:
        return f"--plot: no scenario with a bug here, nothing to plot ({path} not written)", []
    skipped = [r["name"] for r in rows if not r["job"].startswith(PLOTTABLE)]
    rows = [r for r in rows if r["job"].startswith(PLOTTABLE)]
    if not rows:
        return f"--plot: no loss curve for {', '.join(skipped)} ({path} not written)", []
    if workdir:
        curves = run_curves(rows, nproc, Path(workdir) / "curves", timeout)
    else:
        with tempfile.TemporaryDirectory(prefix="zerofix-curves-") as tmp:
            curves = run_curves(rows, nproc, Path(tmp), timeout)
    draw(curves, path)
    note = f"; no curve for {', '.join(skipped)}" if skipped else ""
    return f"--plot: loss over {STEPS} steps for {', '.join(c['name'] for c in curves)} written to {path}{note}", curves


def run_curves(rows: list[dict], nproc: int, workdir: Path, timeout: float) -> list[dict]:
    """{name, verdict, unpatched, patched, reference (lists of STEPS + 1 losses) or error} per row; every job's run
    in one batch."""
    from zerofix.check import jobs, launch, plan, runner

    by_job: dict[str, list[dict]] = {}
    for row in rows:
        by_job.setdefault(row["job"], []).append(row)
    planned = {}
    for job_name, job_rows in by_job.items():
        ranks = 1 if plan.JOBS[job_name].ranks == "1" else nproc
        planned[job_name] = (_deepspeed_curves if job_name == "deepspeed" else _gas_curves)(
            job_name, job_rows, ranks, timeout, jobs)
    # its ranks forked after one import, as the check's own runs are (measure.run): torchrun's agent and a fresh
    # interpreter per rank cost 25 CPU s of imports for a figure of a few seconds' training
    batch = runner.Batch(workdir, fork=True)
    batch.add(*(request for request, _ in planned.values()))
    batch.run()
    curves = []
    for job_name, (request, losses_of) in planned.items():
        job_rows = by_job[job_name]
        try:
            losses = losses_of(batch.folder(request), batch.records(request))
        except launch.LaunchError as exc:
            losses = {r["name"]: {"error": exc.tail} for r in job_rows}
        except Exception as exc:  # noqa: BLE001 - drawn as that panel's failure; the other curves still count
            losses = {r["name"]: {"error": f"{type(exc).__name__}: {exc}"} for r in job_rows}
        curves += [{"name": r["name"], "verdict": r["verdict"], **losses[r["name"]]} for r in job_rows]
    return curves


def _gas_curves(job_name, rows, nproc, timeout, jobs):
    """Trainer and accelerate rows: one window of samples, STEPS epochs. Returns (the request, its losses from
    (folder, records))."""
    from zerofix.check import builders, parity, plan, reference

    trainer = job_name.startswith("trainer-")
    gas = jobs.TRAINER_GAS if trainer else jobs.ACCELERATE_GAS
    stage = plan.JOBS[job_name].zero_stage
    models_of = {r["name"]: jobs.model_of(r["name"]) for r in rows}
    cells = [{"name": m, "model": m, "gas": gas, "samples": gas * jobs.BATCH * nproc, "epochs": STEPS,
              "lr": CURVE_LR[m]} for m in dict.fromkeys(models_of.values())]
    make = builders.trainer_request if trainer else builders.accelerate_request
    request = make(cells, nproc=nproc, zero_stage=stage, lr=jobs.LR, timeout=timeout, name=f"curves-{job_name}")

    def losses(out_dir, records):
        import torch

        out = {}
        for name, model in models_of.items():
            loss_mode = parity.LOSS_MODE[model] if trainer else "batch-mean"
            cell_dir = out_dir / model
            init = torch.load(cell_dir / "init.pt")
            window = reference.windows_from_ranks(
                [r for r in records if r["cell_dir"] == model and r["variant"] == "patched"])[0]
            curve = {}
            for variant in ("unpatched", "patched"):
                states = [init] + [torch.load(cell_dir / variant / f"step{k}.pt") for k in range(1, STEPS + 1)]
                curve[variant] = [reference.window_loss(model, s, window, loss_mode=loss_mode, ranks=nproc)
                                  for s in states]
            state, ref = init, [reference.window_loss(model, init, window, loss_mode=loss_mode, ranks=nproc)]
            for _ in range(STEPS):
                state = reference.reference_state(model, state, [window], loss_mode=loss_mode,
                                                  optimizer_factory=reference.sgd(CURVE_LR[model]), ranks=nproc)
                ref.append(reference.window_loss(model, state, window, loss_mode=loss_mode, ranks=nproc))
            curve["reference"] = ref
            out[name] = curve
        return out

    return request, losses


def _deepspeed_curves(job_name, rows, nproc, timeout, jobs):
    """Raw DeepSpeed rows: the row's loop, STEPS windows, every window on the first window's samples."""
    from zerofix.check import accumulation, builders, reference

    cells = {r["name"]: jobs.ds_cell(r["name"])._replace(windows=STEPS, repeat=True) for r in rows}
    request = builders.ds_request(list(cells.values()), nproc=nproc, timeout=timeout, name="curves-deepspeed")

    def losses(out_dir, records):
        runs = request.interpret(out_dir, records)
        out = {}
        for name, cell in cells.items():
            # Both loops' one update per window: the mean of the window's micro-batch means.
            update = accumulation.updates(cell)[0][0]

            def loss(state, update=update):
                return reference.raw_update_loss(state, update, world=nproc)

            curve = {}
            for variant in ("unpatched", "patched"):
                errors = [e for e in runs[variant][cell.name]["errors"] if e]
                if errors:
                    curve[variant] = None
                    continue
                curve[variant] = [loss(s) for s in [runs["init"], *runs[variant][cell.name]["snapshots"]]]
            states, _ = reference.reference_windows(runs["init"], accumulation.updates(cell), world=nproc,
                                                    optimizer_factory=reference.OPTIMIZERS[cell.optimizer])
            curve["reference"] = [loss(s) for s in [runs["init"], *states]]
            out[name] = curve
        return out

    return request, losses


def draw(curves: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, math.ceil(math.sqrt(len(curves))))  # 4 curves: 2 x 2
    rows = (len(curves) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.6 * rows), squeeze=False)
    for ax, curve in zip(list(axes.flat)[:len(curves)], curves, strict=True):
        ax.set_title(f"{curve['name']}\n{curve['verdict']}", fontsize=9)
        if "error" in curve:
            ax.text(0.5, 0.5, "the curve run failed:\n" + curve["error"][-300:], ha="center", va="center",
                    fontsize=7, wrap=True, transform=ax.transAxes)
            continue
        steps = range(len(curve["reference"]))
        ax.plot(steps, curve["reference"], "k--", lw=2, label="reference (float64, 1 process)")
        for variant, style in (("unpatched", "r-"), ("patched", "b:")):
            if curve[variant] is None:
                ax.text(0.5, 0.9, f"{variant}: crashed", color=style[0], ha="center", transform=ax.transAxes)
            else:
                ax.plot(steps, curve[variant], style, lw=1.8 if variant == "unpatched" else 2.4, label=variant)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss of the window")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
