"""The jobs behind ``zerofix check``: each launches one real run (torchrun or accelerate launch, gloo, CPU) of
its rows, unpatched then patched, and compares every update with the single-process float64 reference.

``run(job, rows, nproc, out_dir, timeout)`` returns, per row name, ``{"unpatched": outcome, "patched": outcome,
"applied": [fix ids]}``: an outcome is ``{"ratio", "cosine", "rel_err"}`` (the worst optimizer step of the
run) or ``{"error": text}``; ``applied`` lists the row's catalogue fixes that the patched run applied.
"""
from __future__ import annotations

import json
from pathlib import Path

from zerofix.check import accumulation, launch, parity, reference

TRAINER_GAS, ACCELERATE_GAS, BATCH, WINDOWS = 8, 4, 2, 2
LR = 5.0  # SGD: large, so the update dominates the fp32 rounding of weights near 1.0 (norms)


def _outcome(comparison: dict) -> dict:
    return {k: comparison[k] for k in ("ratio", "cosine", "rel_err")}


def _applied(status: dict, fixes) -> list[str]:
    return [f for f in fixes if status.get(f) == "applied"]


def model_of(name: str) -> str:
    """The model kind a trainer-* / accelerate-* row trains (its name's suffix)."""
    if name.endswith("-seq-cls"):
        return "seq-cls-llama"
    return "causal-lm" if name.endswith("-causal-lm") else "custom"


def trainer(job, rows, nproc, out_dir, timeout):
    cells = [{"name": model_of(r.name), "model": model_of(r.name), "gas": TRAINER_GAS,
              "samples": WINDOWS * TRAINER_GAS * BATCH * nproc} for r in rows]
    results = parity.trainer_cells(out_dir, cells, nproc=nproc, zero_stage=job.zero_stage, lr=LR, timeout=timeout)
    return {r.name: _variant_rows(results[model_of(r.name)], r.fixes) for r in rows}


def accelerate(job, rows, nproc, out_dir, timeout, *, cells=None, zero_stage=None, ds_config=None):
    cells = cells or [{"name": model_of(r.name), "model": model_of(r.name), "gas": ACCELERATE_GAS,
                       "samples": WINDOWS * ACCELERATE_GAS * BATCH * nproc} for r in rows]
    zero_stage = job.zero_stage if zero_stage is None else zero_stage
    try:
        results = parity.accelerate_cells(out_dir, cells, nproc=nproc, zero_stage=zero_stage, lr=LR,
                                          timeout=timeout, ds_config=ds_config)
    except launch.LaunchError as crash:
        # The unpatched variant runs first in the same ranks: a crash there (accelerate 1.3.0's no_sync under
        # ZeRO-2/3) would hide the patched run. Run it alone; if it crashes too, the row fails.
        patched = parity.accelerate_cells(out_dir / "patched-only", cells, nproc=nproc, zero_stage=zero_stage,
                                          lr=LR, zerofix="on", timeout=timeout, ds_config=ds_config)
        return {r.name: {"unpatched": {"error": crash.tail},
                         "patched": _outcome(patched[model_of(r.name)]["patched"]),
                         "applied": _applied(patched[model_of(r.name)]["patched"]["rank_status"][0], r.fixes)}
                for r in rows}
    return {r.name: _variant_rows(results[model_of(r.name)], r.fixes) for r in rows}


def _variant_rows(result: dict, fixes) -> dict:
    patched = result["patched"]
    return {"unpatched": _outcome(result["unpatched"]), "patched": _outcome(patched),
            "applied": [f for f in _applied(patched["rank_status"][0], fixes) if _acted(patched, f)]}


def _acted(result: dict, fix_id: str) -> bool:
    """False for an entry whose runtime details say it changed nothing in this cell's run (the Trainer's scaling:
    its last trainer, the cell's, had no backward corrected on any rank); True otherwise."""
    runs = [r.get(fix_id) for r in result.get("rank_runtime", ())]
    last = [r[-1] for r in runs if r and isinstance(r[-1], dict) and "corrected" in r[-1]]
    return not last or any(d["corrected"] for d in last)


def ds_cell(name: str) -> accumulation.Cell:
    """deepspeed-zero<s>-manual: 4 backwards then step(), config GAS=1 (the loop divides by 4);
    deepspeed-zero<s>-own: backward + step() per micro-batch, config GAS=4 (DeepSpeed divides);
    deepspeed-zero<s>-offload-*: the same with the optimizer offloaded to the CPU."""
    stage = int(name.split("-")[1][len("zero"):])
    offload = "-offload-" in name
    if name.endswith("-manual"):
        return accumulation.Cell(stage, 1, "a", offload=offload)
    return accumulation.Cell(stage, 4, "b", offload=offload)


def deepspeed(job, rows, nproc, out_dir, timeout, *, cells=None, base_config=None):
    cells = cells or [ds_cell(r.name) for r in rows]
    runs = parity.ds_accumulation(out_dir, cells, nproc=nproc, timeout=timeout, base_config=base_config)
    out = {}
    for row, cell in zip(rows, cells, strict=True):
        entry = {}
        for variant in ("unpatched", "patched"):
            run = runs[variant][cell.name]
            errors = [e for e in run["errors"] if e]
            entry[variant] = ({"error": errors[0]} if errors
                              else _ds_outcome(runs["init"], run["snapshots"], cell, nproc))
        runtime = runs["patched"][cell.name]["runtime"][0]
        entry["applied"] = _applied(runtime["states"] if runtime else {}, row.fixes)
        out[row.name] = entry
    return out


def _ds_outcome(init: dict, snapshots: list[dict], cell, world: int) -> dict:
    """The worst window, each compared from the weights the run had when it started."""
    windows = accumulation.updates(cell)
    if len(snapshots) != len(windows):
        return {"error": f"{len(snapshots)} of {len(windows)} windows recorded"}
    comparisons, start = [], init
    for window, end in zip(windows, snapshots, strict=True):
        states, _ = reference.reference_windows(start, [window], world=world, clip=cell.clip,
                                                optimizer_factory=reference.OPTIMIZERS[cell.optimizer])
        comparisons.append(reference.compare(start, end, states[0]))
        start = end
    return _outcome(max(comparisons, key=lambda c: c["rel_err"]))


ZERO3_LOSS = "zerofix.check.scenarios.zero3_loss"


def zero3_loss(job, rows, nproc, out_dir, timeout, *, tied: bool = False):
    import torch

    from zerofix.check.scenarios import zero3_loss as scenario

    # a tied head (GPT-2, Qwen2) has no bias; the built-in rows' untied head has one
    cells = [{"name": r.name, "mode": r.name.rsplit("-", 1)[1], "tied": tied, "bias": not tied, "chunk_size": 3,
              "loss": "zerofix"} for r in rows]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cells.json").write_text(json.dumps(cells))
    records = launch.torchrun(ZERO3_LOSS, ["--cells", str(out_dir / "cells.json")], nproc=nproc,
                              out_dir=out_dir / "run", timeout=timeout)
    init = torch.load(out_dir / "run" / "init.pt")
    out = {}
    for row, cell in zip(rows, cells, strict=True):
        errors = [r["cells"][cell["name"]].get("error") for r in records if r["cells"][cell["name"]].get("error")]
        if errors:
            out[row.name] = {"unpatched": None, "patched": {"error": errors[0]}, "applied": []}
            continue
        comparisons, before = [], init
        for step, after in enumerate(torch.load(out_dir / "run" / f"{cell['name']}.pt")):
            start, ref = scenario.reference_step(before, step, cell, nproc)
            comparisons.append(reference.compare(start, after, ref))
            before = after
        out[row.name] = {"unpatched": None, "applied": [],
                         "patched": _outcome(max(comparisons, key=lambda c: c["rel_err"]))}
    return out


TRL_SFT = "zerofix.check.scenarios.trl_sft"
TRL_DISTILL = "zerofix.check.scenarios.trl_distill"
TRL_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
}


def trl_accelerate_config(out_dir: Path) -> dict:
    """accelerate launch with DeepSpeed ZeRO-3 and zero3_init_flag: from_pretrained loads partitioned."""
    ds_file = out_dir / "ds_zero3.json"
    ds_file.write_text(json.dumps(TRL_DS_CONFIG))
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
            "machine_rank": 0, "rdzv_backend": "static", "same_network": True,
            "deepspeed_config": {"deepspeed_config_file": str(ds_file), "zero3_init_flag": True}}


def trl_sft(job, rows, nproc, out_dir, timeout):
    """SFTTrainer with loss_type="chunked_nll" unpatched and patched, against the same run whose loss is computed
    from the full logits (SFTTrainer's compute_loss_func): the outcome compares the train losses, grad norms and
    eval losses, step by step. TRL >= 1.6 computes every nll in chunks, so "nll" alone would compare TRL with itself."""
    out_dir = Path(out_dir)
    model_dir = _tiny_llama(out_dir)
    config = trl_accelerate_config(out_dir)

    def sft(name, loss_type, patched):
        args = ["--model-dir", str(model_dir), "--path", "r1", "--loss-type", loss_type]
        if loss_type == "nll":
            args += ["--loss-fn", "full-logits"]
        return launch.accelerate_launch(TRL_SFT, args + (["--zerofix"] if patched else []), config=config,
                                        nproc=nproc, out_dir=out_dir / name, timeout=timeout)

    ref = sft("nll", "nll", False)
    if any("error" in r for r in ref):
        raise launch.LaunchError("the nll reference run failed", tail=_first_error(ref))
    got = {variant: sft(variant, "chunked_nll", variant == "patched") for variant in ("unpatched", "patched")}
    row = rows[0]
    return {row.name: {"unpatched": trl_outcome(got["unpatched"], ref), "patched": trl_outcome(got["patched"], ref),
                       "applied": _applied(got["patched"][0]["status"], row.fixes)}}


def trl_sft_uneven(job, rows, nproc, out_dir, timeout):
    """SFTTrainer, assistant-only masking that gives rank 0 one chunk and rank 1 three, TRL's chunked loss in a
    compute_loss that runs the decoder first (the scenario's ``r4``), against the same run with the full logits.
    The unpatched run hangs on TRL 1.6 - 1.14 (``_uneven_row``)."""
    out_dir = Path(out_dir)
    model_dir = _tiny_llama(out_dir)
    config = trl_accelerate_config(out_dir)

    def sft(variant, limit):
        loss_type = "nll" if variant == "reference" else "chunked_nll"
        args = ["--model-dir", str(model_dir), "--path", "r4", "--loss-type", loss_type]
        return launch.accelerate_launch(TRL_SFT, args + (["--zerofix"] if variant == "patched" else []),
                                        config=config, nproc=nproc, out_dir=out_dir / variant, timeout=limit)

    return _uneven_row(rows[0], sft, timeout, "the full-logits reference run failed")


def trl_distill_uneven(job, rows, nproc, out_dir, timeout):
    """DistillationTrainer's own step, completions of different lengths on the ranks, 4 rows per chunk, against the
    same run with one chunk per rank (the full logits of the counted tokens). The unpatched run's collectives stop
    matching: gloo aborts, NCCL would hang (``_uneven_row``)."""
    from zerofix.check.scenarios import trl_distill as scenario

    out_dir = Path(out_dir)
    _quiet_dir(out_dir)
    student, teacher = scenario.make_models(out_dir / "models")
    config = trl_accelerate_config(out_dir)

    def distill(variant, limit):
        chunk = scenario.WHOLE if variant == "reference" else scenario.CHUNK
        args = ["--student", str(student), "--teacher", str(teacher), "--chunk", str(chunk)]
        return launch.accelerate_launch(TRL_DISTILL, args + (["--zerofix"] if variant == "patched" else []),
                                        config=config, nproc=nproc, out_dir=out_dir / variant, timeout=limit)

    return _uneven_row(rows[0], distill, timeout, "the one-chunk reference run failed")


def _uneven_row(row, run, timeout, reference_failed):
    """A row whose unpatched run may never finish: ``run(variant, limit)`` for "reference", "patched" (first) and
    "unpatched", which gets three times the patched run's time (at least 30 s). A hang (then every rank is
    killed) or gloo's abort on mismatched collectives is the unpatched result, said as such."""
    import time

    ref = run("reference", timeout)
    if any("error" in r for r in ref):
        raise launch.LaunchError(reference_failed, tail=_first_error(ref))
    began = time.monotonic()
    patched = run("patched", timeout)
    bound = max(30.0, 3 * (time.monotonic() - began))
    try:
        unpatched = trl_outcome(run("unpatched", bound), ref)
    except launch.LaunchError as exc:
        if "timed out" in str(exc):
            unpatched = {"error": f"hung: no result in {bound:.0f} s (3 x the patched run); the ranks were killed"}
        elif "collective mismatch" in f"{exc}\n{exc.tail}":
            unpatched = {"error": "crash: the ranks' collectives did not match (gloo aborted; NCCL would hang)"}
        else:
            raise
    return {row.name: {"unpatched": unpatched, "patched": trl_outcome(patched, ref),
                       "applied": _applied(patched[0]["status"], row.fixes)}}


def trl_grpo(job, rows, nproc, out_dir, timeout):
    """GRPOTrainer, one SGD step per row from the same weights, unpatched and patched, against the update
    computed by hand in float64 from the inputs every micro-step received (scenario ``trl_grpo``)."""
    from zerofix.check.scenarios import trl_grpo as scenario

    out_dir = Path(out_dir)
    model_dir = _tiny_llama(out_dir)
    cases = {r.name: GRPO_CASES[r.name] for r in rows}
    results = {r.name: {} for r in rows}
    status = {}
    for variant in ("unpatched", "patched"):
        args = ["--model-dir", str(model_dir), "--cases", json.dumps(list(cases.values()))]
        out = out_dir / variant
        records = launch.torchrun("zerofix.check.scenarios.trl_grpo", args + (["--zerofix"] if variant == "patched"
                                  else []), nproc=nproc, out_dir=out, timeout=timeout)
        status[variant] = records[0]["status"]
        if variant == "patched":
            patched_records = records
        for row_name, case in cases.items():
            name = scenario.case_name(case)
            failed = next((r["cases"][name]["error"] for r in records if "error" in r["cases"][name]), None)
            if failed:
                results[row_name][variant] = {"error": failed}
                continue
            res = scenario.reference_update(model_dir, sorted(out.glob(f"{name}-rank*.pt")))
            results[row_name][variant] = _outcome(reference.compare_updates(res["got"], res["ref"]))
    acted = {}  # the Trainer scaling names itself only where it changed a backward of the row's trainer
    for row_name, case in cases.items():
        details = [r["cases"][scenario.case_name(case)].get("scaling") for r in patched_records]
        acted[row_name] = any(d and d.get("corrected") for d in details)
    return {r.name: {**results[r.name], "applied": [f for f in _applied(status["patched"], r.fixes)
                                                    if f != "transformers-trainer-scaling" or acted[r.name]]}
            for r in rows}


# zerofix check's GRPO rows: steps_per_generation above and below GAS (generation batches divisible by
# num_generations on 1 and 2 ranks)
GRPO_CASES = {
    "trl-grpo-dapo-spg4-gas2": {"loss_type": "dapo", "spg": 4, "gas": 2},
    "trl-grpo-dapo-spg2-gas4": {"loss_type": "dapo", "spg": 2, "gas": 4},
}


def _tiny_llama(out_dir: Path) -> Path:
    """The TRL jobs' tiny Llama and tokenizer, saved under ``out_dir`` (which is created)."""
    from zerofix.check.scenarios import trl_sft as scenario

    _quiet_dir(out_dir)
    return scenario.make_model_dir(out_dir / "tiny-llama")


def _quiet_dir(out_dir: Path) -> None:
    """Create a TRL job's folder; models are saved there without save_pretrained's progress bar, which would
    break check's own."""
    from transformers.utils import logging as hf_logging

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()


def _first_error(records) -> str:
    return next(f"rank {r['rank']}: {r['error']}" for r in records if "error" in r)


def trl_outcome(records: list[dict], ref: list[dict]) -> dict:
    """rel_err: the largest relative difference of any logged train loss, grad norm or eval loss;
    ratio: the grad norms' sum over the reference's (no cosine: parameters are not compared)."""
    if any("error" in r for r in records):
        return {"error": _first_error(records)}
    worst, norms, ref_norms = 0.0, 0.0, 0.0
    for got, want in zip(records, ref, strict=True):
        for key in ("train_loss", "grad_norm", "eval_loss"):
            if len(got[key]) != len(want[key]):
                return {"error": f"{key}: {len(got[key])} values logged, {len(want[key])} in the nll run"}
            worst = max([worst] + [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got[key], want[key], strict=True)])
        norms += sum(got["grad_norm"])
        ref_norms += sum(want["grad_norm"])
    return {"ratio": norms / ref_norms if ref_norms else float("nan"), "cosine": None, "rel_err": worst}


# ------------------------------------------------------------------ a user's configuration (--deepspeed)
# ``user``: {"config": userconfig.UserConfig, "model": the causal LM's kind ("causal-lm" or "hf:<file>"),
# "tied": whether that model ties its head, "average_tokens": TrainingArguments.average_tokens_across_devices}


def _user_model(row_name: str, user: dict) -> str:
    """The model a row of a user's configuration trains: --model's (a causal LM's in every -causal-lm row, a
    sequence classifier's in the Trainer's -seq-cls row), a tiny Llama, or the custom module."""
    sequence = user.get("task") == "sequence"
    if row_name.endswith("-seq-cls"):
        return user["model"]
    if row_name.endswith("-causal-lm"):
        return "causal-lm" if sequence else user["model"]
    return "custom"


def your_trainer(job, rows, nproc, out_dir, timeout, user):
    cfg = user["config"]
    cells = [{"name": model_of(r.name), "model": _user_model(r.name, user), "gas": cfg.gas, "bs": cfg.micro_batch,
              "samples": WINDOWS * cfg.gas * cfg.micro_batch * nproc, "clip": cfg.clip, "bf16": cfg.dtype == "bf16",
              "average_tokens": user["average_tokens"]} for r in rows]
    results = parity.trainer_cells(out_dir, cells, nproc=nproc, zero_stage=cfg.stage, lr=LR, timeout=timeout,
                                   ds_config=cfg.ds)
    return {r.name: _variant_rows(results[model_of(r.name)], r.fixes) for r in rows}


def your_accelerate(job, rows, nproc, out_dir, timeout, user):
    cfg = user["config"]
    cells = [{"name": model_of(r.name), "model": _user_model(r.name, user), "gas": cfg.gas, "clip": cfg.clip,
              "samples": WINDOWS * cfg.gas * BATCH * nproc} for r in rows]
    return accelerate(job, rows, nproc, out_dir, timeout, cells=cells, zero_stage=cfg.stage, ds_config=cfg.ds)


def user_ds_cell(name: str, cfg) -> accumulation.Cell:
    """deepspeed-manual: the loop accumulates ``cfg.manual_length`` micro-batches itself with config GAS=1;
    deepspeed-own: backward + step() per micro-batch at the configuration's GAS."""
    common = {"grad_clip": cfg.clip, "offload": cfg.offload == "cpu", "dtype": cfg.dtype}
    if name.endswith("-manual"):
        return accumulation.Cell(cfg.stage, 1, "a", length=cfg.manual_length, **common)
    return accumulation.Cell(cfg.stage, cfg.gas, "b", length=cfg.gas, **common)


def your_deepspeed(job, rows, nproc, out_dir, timeout, user):
    cells = [user_ds_cell(r.name, user["config"]) for r in rows]
    return deepspeed(job, rows, nproc, out_dir, timeout, cells=cells, base_config=user["config"].ds)


def your_zero3_loss(job, rows, nproc, out_dir, timeout, user):
    return zero3_loss(job, rows, nproc, out_dir, timeout, tied=user["tied"])


RUNNERS = {"deepspeed": deepspeed, "zero3-loss": zero3_loss, "trl-sft": trl_sft, "trl-sft-uneven": trl_sft_uneven,
           "trl-distill-uneven": trl_distill_uneven, "trl-grpo": trl_grpo}
USER_RUNNERS = {"your-trainer": your_trainer, "your-accelerate": your_accelerate, "your-deepspeed": your_deepspeed,
                "your-zero3-loss": your_zero3_loss}


def runner(job):
    """The function that runs a job: by name, or by family (trainer-*, accelerate-*)."""
    return RUNNERS.get(job.name) or {"trainer": trainer, "accelerate": accelerate}[job.name.split("-", 1)[0]]


def run(job, rows, nproc: int, out_dir, timeout: float, user: dict | None = None) -> dict:
    if job.name in USER_RUNNERS:
        return USER_RUNNERS[job.name](job, rows, nproc, Path(out_dir), timeout, user)
    return runner(job)(job, rows, nproc, Path(out_dir), timeout)
