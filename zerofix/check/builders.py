"""Every request of the scenarios' runs, built in one place (issue 68): what ``zerofix check``'s jobs and the test
suite's distributed tests ask a ``runner.Batch`` to run, and how each run's records are read (``interpret``, with the
comparisons of ``parity``). A run that needs a launch of its own (activation at interpreter start) has its helper here
too (``trainer_gas``, ``ds_accumulation``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from zerofix.check import launch, runner
from zerofix.check.parity import bitwise_same, compare_variants, loss_mode_of

TRAINER_GAS = "zerofix.check.scenarios.trainer_gas"
ACCELERATE_LOOP = "zerofix.check.scenarios.accelerate_loop"
DS_ACCUMULATION = "zerofix.check.scenarios.ds_accumulation"
ZERO3_LOSS = "zerofix.check.scenarios.zero3_loss"
TRL_SFT = "zerofix.check.scenarios.trl_sft"
TRL_DISTILL = "zerofix.check.scenarios.trl_distill"
TRL_GRPO = "zerofix.check.scenarios.trl_grpo"
SEQUENCE_PARALLEL = "zerofix.check.scenarios.sequence_parallel"
TRL_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
}


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

def zero3_loss_request(cells, *, nproc: int, timeout: float = 600, name: str = "zero3-loss") -> runner.Request:
    """The chunked-loss cells of ``zerofix.check.scenarios.zero3_loss`` in one run; its result: the ranks' records
    (the snapshots and ``init.pt`` are in the request's folder)."""
    return runner.Request(name=name, module=ZERO3_LOSS, argv=("--cells", "{out}/cells.json"), nproc=nproc,
                          files=runner.files(**{"cells.json": list(cells)}), timeout=timeout, imports=("deepspeed",),
                          interpret=lambda folder, records: records)

def trl_accelerate_config(ds_file) -> dict:
    """accelerate launch with DeepSpeed ZeRO-3 (``TRL_DS_CONFIG`` in ``ds_file``) and zero3_init_flag: from_pretrained
    loads partitioned."""
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
            "machine_rank": 0, "rdzv_backend": "static", "same_network": True,
            "deepspeed_config": {"deepspeed_config_file": str(ds_file), "zero3_init_flag": True}}

def trl_request(module: str, name: str, args, *, nproc: int, timeout: float, late: bool = False,
                bound=None) -> runner.Request:
    """A TRL scenario run as ``accelerate launch`` with ``trl_accelerate_config`` runs it: with the variables that
    launch sets for this run only (the session computes them with accelerate's own launcher code,
    ``launch.accelerate_env``); the DeepSpeed config is a file of the run's folder."""
    return runner.Request(name=name, module=module, argv=tuple(args), nproc=nproc, timeout=timeout, late=late,
                          bound=bound, files=runner.files(**{"ds_zero3.json": TRL_DS_CONFIG}),
                          accelerate=json.dumps(trl_accelerate_config("{out}/ds_zero3.json")),
                          imports=("deepspeed", "transformers.trainer", "trl"))


def grpo_request(name: str, args, *, nproc: int, timeout: float, patched: bool) -> runner.Request:
    """GRPOTrainer's scenario, one variant (``--zerofix`` for the patched one; the unpatched one last: it may stop)."""
    return runner.Request(name=name, module=TRL_GRPO, nproc=nproc, timeout=timeout,
                          argv=tuple(list(args) + (["--zerofix"] if patched else [])), late=not patched,
                          imports=("transformers.trainer", "trl"))


def sp_request(cells, *, nproc: int, timeout: float, name: str) -> runner.Request:
    """The Trainer under DeepSpeed Ulysses, ``cells`` unpatched then patched in one run; its result: the ranks'
    records."""
    return runner.Request(name=name, module=SEQUENCE_PARALLEL, argv=("--cells", "{out}/cells.json", "--out", "{out}"),
                          nproc=nproc, files=runner.files(**{"cells.json": list(cells)}), timeout=timeout,
                          imports=("deepspeed", "transformers.trainer"), interpret=lambda folder, records: records)
