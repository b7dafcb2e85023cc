"""Run a scenario and compare every variant's update with the single-process reference."""
from __future__ import annotations

import sys
from pathlib import Path

from zerofix.check import launch, runner

TRAINER_GAS = "zerofix.check.scenarios.trainer_gas"
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


def trainer_gas_request(*, model: str = "causal-lm", nproc: int = 1, gas: int = 8, lr: float = 5.0,
                        zerofix: str = "both", extra_args=(), timeout: float = 600, also_last: bool = False,
                        name: str = "trainer-gas") -> runner.Request:
    """One Trainer cell; its result: {variant: comparison + ``rank_status`` (per rank, fix id -> state)}.
    ``also_last``: each variant also carries ``vs_last``, its comparison with a run that keeps only each rank's
    last micro-batch of every window (how a broken accumulator behaves)."""
    argv = ("--model", model, "--gas", str(gas), "--lr", str(lr), "--zerofix", zerofix, *extra_args)

    def interpret(out_dir: Path, records: list[dict]) -> dict:
        return compare_variants(out_dir, records, model=model, nproc=nproc, lr=lr, also_last=also_last)

    deepspeed = "--zero-stage" in extra_args
    imports = ("transformers.trainer", "accelerate") + (("deepspeed",) if deepspeed else ())
    return runner.Request(name=name, module=TRAINER_GAS, argv=argv, nproc=nproc, timeout=timeout,
                          interpret=interpret, imports=imports, needs_group=nproc > 1 or deepspeed)


def trainer_gas(out_dir, *, env=None, launcher_prefix=(), python: str = sys.executable, **options) -> dict:
    """``trainer_gas_request`` run on its own, its files in ``out_dir``; with ``env`` or ``launcher_prefix``
    (activation by the environment or ``zerofix run``, which act at interpreter start) in a launch of its own."""
    request = trainer_gas_request(**options)
    if env is None and not launcher_prefix and python == sys.executable:
        return runner.alone(request, out_dir)
    records = launch.torchrun(TRAINER_GAS, list(request.argv), nproc=request.nproc, out_dir=Path(out_dir), env=env,
                              launcher_prefix=launcher_prefix, python=python, timeout=request.timeout)
    return request.interpret(Path(out_dir), records)


def trainer_request(cells, *, nproc: int = 1, zero_stage: int | None = None, lr: float = 5.0,
                    zerofix: str = "both", timeout: float = 900, ds_config: dict | None = None,
                    name: str = "trainer", fsdp: int | None = None, extra_args=(),
                    fsdp_config: dict | None = None) -> runner.Request:
    """Several Trainer cells (dicts: name, model, gas, samples, average_tokens, lr, and for a user's
    configuration bs, clip, bf16) in one run, with or without DeepSpeed (``ds_config``: a user's resolved
    configuration instead of the scenario's); its result: {cell name: {variant: comparison + rank_status}}."""
    cells = list(cells)

    def interpret(out_dir: Path, records: list[dict]) -> dict:
        results = {}
        for cell in cells:
            cell_records = [r for r in records if r["cell_dir"] == cell["name"]]
            loss_mode = cell.get("loss_modes") or loss_mode_of(cell["model"], cell.get("loss", "model"))
            average = cell.get("average_tokens", True)
            if average is None:  # the release's default, as the ranks' TrainingArguments had it
                average = all(r["average_tokens"] for r in cell_records)
            if not isinstance(loss_mode, list) and loss_mode == "token-mean" and not average:
                loss_mode = "rank-token-mean"  # each rank normalises by its own tokens, then ranks are averaged
            results[cell["name"]] = compare_variants(out_dir / cell["name"], cell_records, model=cell["model"],
                                                     nproc=nproc, lr=cell.get("lr", lr), loss_mode=loss_mode,
                                                     clip=cell.get("clip", 0.0))
            if "patched" in results[cell["name"]]:
                results[cell["name"]]["patched"]["bitwise_as_unpatched"] = bitwise_same(out_dir / cell["name"])
            if cell.get("unpatched_mode"):  # the bug's own reference: how the unpatched run weights the loss
                results[cell["name"]]["unpatched_as_bug"] = compare_variants(
                    out_dir / cell["name"], [r for r in cell_records if r["variant"] == "unpatched"],
                    model=cell["model"], nproc=nproc, lr=cell.get("lr", lr), loss_mode=cell["unpatched_mode"],
                    clip=cell.get("clip", 0.0))["unpatched"]
        return results

    return _cells_request(TRAINER_GAS, name, cells, interpret, nproc=nproc, zero_stage=zero_stage, lr=lr,
                          zerofix=zerofix, timeout=timeout, ds_config=ds_config,
                          extra=(("--fsdp", str(fsdp)) if fsdp else ()) + tuple(extra_args), fsdp_config=fsdp_config)


def trainer_cells(out_dir, cells, **options) -> dict:
    """``trainer_request``'s cells run on their own, their files in ``out_dir``."""
    return runner.alone(trainer_request(cells, **options), out_dir)


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


ACCELERATE_LOOP = "zerofix.check.scenarios.accelerate_loop"


def accelerate_request(cells, *, nproc: int = 1, zero_stage: int | None = None, lr: float = 5.0,
                       zerofix: str = "both", timeout: float = 900, ds_config: dict | None = None, opt_in=(),
                       name: str = "accelerate", late: bool = False) -> runner.Request:
    """Plain ``accelerator.accumulate`` loops (dicts: name, model, gas, samples) in one run; its result:
    {cell name: {variant: comparison + rank_status + left_over}}. The loss meant is the mean of the
    micro-batch means of a window (each micro-batch's loss is its own mean, accelerate divides).
    ``opt_in``: opt-in fix ids the patched variant applies next to the default ones."""
    cells = list(cells)

    def interpret(out_dir: Path, records: list[dict]) -> dict:
        results = {}
        for cell in cells:
            cell_records = [r for r in records if r["cell_dir"] == cell["name"]]
            results[cell["name"]] = compare_variants(out_dir / cell["name"], cell_records, model=cell["model"],
                                                     nproc=nproc, lr=lr, loss_mode="batch-mean",
                                                     clip=cell.get("clip", 0.0))
            for variant, result in results[cell["name"]].items():
                result["left_over"] = sum(len(r["left_over"]) for r in cell_records if r["variant"] == variant)
        return results

    return _cells_request(ACCELERATE_LOOP, name, cells, interpret, nproc=nproc, zero_stage=zero_stage, lr=lr,
                          zerofix=zerofix, timeout=timeout, ds_config=ds_config, late=late,
                          extra=("--opt-in", ",".join(opt_in)) if opt_in else ())


def accelerate_cells(out_dir, cells, **options) -> dict:
    """``accelerate_request``'s cells run on their own, their files in ``out_dir``."""
    return runner.alone(accelerate_request(cells, **options), out_dir)


def _cells_request(module, name, cells, interpret, *, nproc, zero_stage, lr, zerofix, timeout, ds_config,
                   extra=(), late=False, fsdp_config=None) -> runner.Request:
    argv = ["--cells", "{out}/cells.json", "--lr", str(lr), "--zerofix", zerofix, *extra]
    files = {"cells.json": cells}
    if fsdp_config is not None:
        files["fsdp_config.json"] = fsdp_config
        argv += ["--fsdp-config", "{out}/fsdp_config.json"]
    if zero_stage is not None:
        argv += ["--zero-stage", str(zero_stage)]
    if ds_config is not None:
        files["ds_config.json"] = ds_config
        argv += ["--ds-config", "{out}/ds_config.json"]
    imports = ("transformers.trainer", "accelerate") + (("deepspeed",) if zero_stage is not None else ())
    return runner.Request(name=name, module=module, argv=tuple(argv), nproc=nproc, files=runner.files(**files),
                          timeout=timeout, interpret=interpret, imports=imports, late=late,
                          needs_group=nproc > 1 or zero_stage is not None or "--fsdp" in extra)


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


DS_ACCUMULATION = "zerofix.check.scenarios.ds_accumulation"


def ds_request(cells, *, nproc: int = 2, variants=("unpatched", "patched"), fixes=None, timeout: float = 900,
               base_config: dict | None = None, name: str = "deepspeed") -> runner.Request:
    """The raw DeepSpeed loops of ``cells`` in one run; its result: {variant: {cell name: {"snapshots", "norms"
    (per rank), "runtime", "errors", "events", "window_reads"}}} plus "init" (initial weights) and "world"."""
    cells = list(cells)
    argv = ["--cells", "{out}/cells.json", "--variants", ",".join(variants)]
    files = {"cells.json": [c._asdict() for c in cells]}
    if fixes is not None:
        argv += ["--fixes", ",".join(fixes)]
    if base_config is not None:
        files["base_config.json"] = base_config
        argv += ["--base-config", "{out}/base_config.json"]

    def interpret(out_dir: Path, records: list[dict]) -> dict:
        import torch

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
                    "events": [r["cells"][variant][cell.name].get("events") for r in records],
                    "window_reads": (torch.load(out_dir / variant / f"{cell.name}.reads.pt")
                                     if (out_dir / variant / f"{cell.name}.reads.pt").exists() else None),
                }
                for cell in cells
            }
        return results

    return runner.Request(name=name, module=DS_ACCUMULATION, argv=tuple(argv), nproc=nproc,
                          files=runner.files(**files), timeout=timeout, interpret=interpret, imports=("deepspeed",))


def ds_accumulation(out_dir, cells, *, env=None, python: str = sys.executable, **options) -> dict:
    """``ds_request``'s loops run on their own, their files in ``out_dir``; with ``env`` (activation by the
    environment, which acts at interpreter start) in a launch of their own."""
    request = ds_request(cells, **options)
    if env is None and python == sys.executable:
        return runner.alone(request, out_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file_name, text in request.files:
        (out_dir / file_name).write_text(text)
    args = [a.replace("{out}", str(out_dir)) for a in request.argv]
    return request.interpret(out_dir, launch.torchrun(DS_ACCUMULATION, args, nproc=request.nproc, out_dir=out_dir,
                                                      env=env, python=python, timeout=request.timeout))


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
