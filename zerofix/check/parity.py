"""Every variant's update compared with the single-process reference (the requests that produce them:
``zerofix.check.builders``)."""
from __future__ import annotations

from pathlib import Path

from zerofix.check import launch

LOSS_MODE = {"causal-lm": "token-mean", "custom": "batch-mean", "moe": "moe", "fused-mean-llama": "batch-mean"}
# Trainer cells whose loss is computed by the Trainer's user, not the model (``loss`` of a cell): the
# micro-batch mean of the causal LM's tokens, returned by a compute_loss override or a compute_loss_func.
MEAN_LOSSES = ("subclass-mean", "func-mean", "plus-zero-mean", "times-positive", "plus-reg-mean", "zeros-like-mean",
               "steps-divided-mean", "func-steps-divided-mean", "four-term-mean")


def loss_mode_of(model: str, loss: str = "model") -> str:
    """The loss a model kind means: a Hugging Face model (``hf:<config>``) takes loss kwargs, as causal-lm; a
    sequence-level head counts samples (token-mean over samples); a user's micro-batch mean is a batch-mean."""
    if loss in MEAN_LOSSES:
        return "batch-mean"
    if model.startswith("hf:"):
        from zerofix.check import models

        if models.loss_of(model) == "moe":
            return "moe"
    return LOSS_MODE.get(model, "token-mean")


def bitwise_same(cell_dir: Path) -> bool | None:
    """Whether the patched run ended with bitwise the unpatched run's weights, having started from bitwise the
    same ones; None when the cell did not run both, or the two started apart (a second model built under
    ZeRO-3 is initialised differently)."""
    import torch

    paths = {v: (cell_dir / v / "init.pt", cell_dir / v / "final.pt") for v in ("unpatched", "patched")}
    if not all(p.exists() for pair in paths.values() for p in pair):
        return None
    (init_u, final_u), (init_p, final_p) = ([torch.load(p) for p in pair] for pair in paths.values())
    if not all(torch.equal(init_u[k], init_p[k]) for k in init_u):
        return None
    return all(torch.equal(final_u[k], final_p[k]) for k in final_u)


def compare_variants(out_dir: Path, records: list[dict], *, model: str, nproc: int, lr: float,
                     loss_mode: str | None = None, also_last: bool = False, clip: float = 0.0) -> dict:
    import torch

    from zerofix.check import reference

    shared_init = torch.load(out_dir / "init.pt")
    loss_mode = loss_mode or loss_mode_of(model)
    modes = loss_mode if isinstance(loss_mode, list) else None  # one per window (a loss that changes its kind)
    results = {}
    for variant in sorted({r["variant"] for r in records}):
        own = out_dir / variant / "init.pt"  # the weights this variant started from, where it saved them
        init = torch.load(own) if own.exists() else shared_init
        ranks = sorted((r for r in records if r["variant"] == variant), key=lambda r: r["rank"])
        if len(ranks) != nproc:
            raise launch.LaunchError(f"{variant}: {len(ranks)} of {nproc} ranks reported")
        windows = reference.windows_from_ranks(ranks)
        final = torch.load(out_dir / variant / "final.pt")
        snapshots = [out_dir / variant / f"step{k}.pt" for k in range(1, len(windows) + 1)]
        if len(windows) > 1 and all(p.exists() for p in snapshots):
            # Window by window, each from the weights the run had when it started: over several windows
            # the float32 rounding of the run would otherwise compound into the comparison.
            starts = [init] + [torch.load(p) for p in snapshots[:-1]]
            per_window = [
                reference.compare(start, torch.load(end), reference.reference_state(
                    model, start, [window], loss_mode=modes[i] if modes else loss_mode,
                    optimizer_factory=reference.sgd(lr), ranks=nproc, clip=clip))
                for i, (start, end, window) in enumerate(zip(starts, snapshots, windows, strict=True))]
            comparison = dict(max(per_window, key=lambda c: c["rel_err"]))
            comparison["per_window"] = per_window
        else:
            ref = reference.reference_state(model, init, windows, loss_mode=loss_mode,
                                            optimizer_factory=reference.sgd(lr), ranks=nproc, clip=clip)
            comparison = reference.compare(init, final, ref)
        if also_last:
            last = reference.reference_state(model, init, windows, loss_mode=loss_mode,
                                             optimizer_factory=reference.sgd(lr), last_of_each=nproc)
            comparison["vs_last"] = reference.compare(init, final, last)
        results[variant] = {**comparison, "windows": [len(w) for w in windows],
                            "rank_status": [{s["id"]: s["state"] for s in r["status"]} for r in ranks],
                            "grad_norms": [r.get("grad_norms", []) for r in ranks],
                            "rank_runtime": [{s["id"]: s.get("runtime", ()) for s in r["status"]} for r in ranks],
                            "engine": [r.get("engine") for r in ranks],
                            "device": [r.get("device") for r in ranks],
                            "step_skipped": [r.get("step_skipped") for r in ranks],
                            "kept_types": [r.get("kept_types") for r in ranks],
                            "warnings": [r.get("zerofix_warnings", []) for r in ranks]}
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
