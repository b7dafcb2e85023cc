"""The jobs behind ``zerofix check``: each plans the runs of its rows (``runner.Request``s, unpatched and patched)
and reads their results into one outcome per row, comparing every update with the single-process float64
reference. The command runs every job's requests in one batch (one session per number of ranks).

``plan(job, rows, nproc, timeout, workdir, user)`` returns a ``Planned``: its ``requests``, and ``results(batch)``,
per row name ``{"unpatched": outcome, "patched": outcome, "applied": [fix ids]}``: an outcome is ``{"ratio",
"cosine", "rel_err"}`` (the worst optimizer step of the run) or ``{"error": text}``; ``applied`` lists the row's
catalogue fixes that the patched run applied. ``results`` raises a run's ``LaunchError`` where nothing could be
measured (the row then fails with that run's own cause).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

from zerofix.check import accumulation, builders, launch

TRAINER_GAS, ACCELERATE_GAS, BATCH, WINDOWS = 8, 4, 2, 2
LR = 5.0  # SGD: large, so the update dominates the fp32 rounding of weights near 1.0 (norms)


class Planned(NamedTuple):
    requests: list
    results: Callable  # (runner.Batch) -> {row name: measured}


def _outcome(comparison: dict) -> dict:
    return {k: comparison[k] for k in ("ratio", "cosine", "rel_err")}


def _applied(status: dict, fixes) -> list[str]:
    return [f for f in fixes if status.get(f) == "applied"]


def model_of(name: str) -> str:
    """The model kind a trainer-* / accelerate-* row trains (its name's suffix)."""
    if name.endswith("-seq-cls"):
        return "seq-cls-llama"
    if name.endswith("-moe"):
        return "moe"
    return "causal-lm" if name.endswith("-causal-lm") else "custom"


def trainer(job, rows, nproc, timeout, workdir, *, cells=None, zero_stage=None, ds_config=None, fsdp_config=None):
    cells = cells or [{"name": model_of(r.name), "model": model_of(r.name), "gas": TRAINER_GAS,
                       "samples": WINDOWS * TRAINER_GAS * BATCH * nproc} for r in rows]
    zero_stage = job.zero_stage if zero_stage is None else zero_stage
    # One process without DeepSpeed: a request per cell, so that the ranks of the session that hosts them share them
    by_cell = nproc == 1 and zero_stage is None and job.fsdp is None
    requests = [builders.trainer_request(part, nproc=nproc, zero_stage=zero_stage, lr=LR, timeout=timeout,
                                       ds_config=ds_config, name=job.name, fsdp=job.fsdp,
                                       fsdp_config=fsdp_config if job.fsdp else None)
                for part in ([[c] for c in cells] if by_cell else [cells])]

    def results(batch):
        measured = {name: cell for request in requests for name, cell in batch.result(request).items()}
        return {r.name: _variant_rows(measured[model_of(r.name)], r.fixes) for r in rows}

    return Planned(requests, results)


def accelerate(job, rows, nproc, timeout, workdir, *, cells=None, zero_stage=None, ds_config=None):
    """The unpatched and the patched loops as two runs, the unpatched one late: it may crash by design (accelerate
    1.3.0's no_sync under ZeRO-2/3), which then is that row's unpatched result."""
    cells = cells or [{"name": model_of(r.name), "model": model_of(r.name), "gas": ACCELERATE_GAS,
                       "samples": WINDOWS * ACCELERATE_GAS * BATCH * nproc} for r in rows]
    zero_stage = job.zero_stage if zero_stage is None else zero_stage
    variants = {v: builders.accelerate_request(cells, nproc=nproc, zero_stage=zero_stage, lr=LR, timeout=timeout,
                                             ds_config=ds_config, zerofix=z, name=f"{job.name}-{v}",
                                             late=v == "unpatched")
                for v, z in (("patched", "on"), ("unpatched", "off"))}

    def results(batch):
        patched = batch.result(variants["patched"])
        try:
            unpatched = batch.result(variants["unpatched"])
        except launch.LaunchError as crash:
            unpatched = {name: {"unpatched": {"error": crash.tail}} for name in patched}
        return {r.name: _variant_rows({**unpatched[model_of(r.name)], **patched[model_of(r.name)]}, r.fixes)
                for r in rows}

    return Planned(list(variants.values()), results)


def _variant_rows(result: dict, fixes) -> dict:
    patched = result["patched"]
    unpatched = result["unpatched"]
    return {"unpatched": unpatched if "error" in unpatched else _outcome(unpatched), "patched": _outcome(patched),
            "applied": [f for f in _applied(patched["rank_status"][0], fixes) if _acted(patched, f)]}


def _acted(result: dict, fix_id: str) -> bool:
    """False for an entry whose runtime details say it changed nothing in this cell's run (the Trainer's scaling:
    its last trainer, the cell's, had no backward corrected on any rank; a bf16 entry: it met no optimizer of the
    class it acts on, DeepSpeed having built another); True otherwise."""
    runs = [r.get(fix_id) for r in result.get("rank_runtime", ())]
    last = [r[-1] for r in runs if r and isinstance(r[-1], dict) and "corrected" in r[-1]]
    return not last or any(d["corrected"] for d in last)


def ds_cell(name: str) -> accumulation.Cell:
    """deepspeed-zero<s>-manual: 4 backwards then step(), config GAS=1 (the loop divides by 4);
    deepspeed-zero<s>-own: backward + step() per micro-batch, config GAS=4 (DeepSpeed divides);
    deepspeed-zero<s>-offload-*: the same with the optimizer offloaded to the CPU;
    deepspeed-zero1-bf16-*: in bf16 with an fp32 gradient accumulator (DeepSpeed's BF16_Optimizer);
    deepspeed-zero0-bf16-*: in bf16 (FP16_UnfusedOptimizer from 0.17.6)."""
    stage = int(name.split("-")[1][len("zero"):])
    options = {"offload": "-offload-" in name}
    if "-bf16-" in name:
        options.update(dtype="bf16", accum_fp32=stage == 1)
    if name.endswith("-manual"):
        return accumulation.Cell(stage, 1, "a", **options)
    return accumulation.Cell(stage, 4, "b", **options)


def deepspeed(job, rows, nproc, timeout, workdir, *, cells=None, base_config=None):
    cells = cells or [ds_cell(r.name) for r in rows]
    request = builders.ds_request(cells, nproc=nproc, timeout=timeout, base_config=base_config, name=job.name)

    def results(batch):
        runs = batch.result(request)
        out = {}
        for row, cell in zip(rows, cells, strict=True):
            entry = {}
            for variant in ("unpatched", "patched"):
                run = runs[variant][cell.name]
                errors = [e for e in run["errors"] if e]
                entry[variant] = ({"error": errors[0]} if errors
                                  else _ds_outcome(runs["init"], run["snapshots"], cell, nproc))
            runtime = runs["patched"][cell.name]["runtime"][0]
            applied = _applied(runtime["states"] if runtime else {}, row.fixes)
            engine = (runtime or {}).get("engine")
            if engine is not None and not engine.get("flushed"):  # it followed DeepSpeed: it changed nothing here
                applied = [f for f in applied if f != "deepspeed-manual-accumulation"]
            # each bf16 entry acts on one optimizer class only: not named where DeepSpeed built another
            built = (runtime or {}).get("optimizer")
            applied = [f for f in applied if _BF16_OPTIMIZER.get(f, built) == built]
            entry["applied"] = applied
            out[row.name] = entry
        return out

    return Planned([request], results)


_BF16_OPTIMIZER = {"deepspeed-bf16-boundary-reduction": "BF16_Optimizer",
                   "deepspeed-bf16-loss-scale": "FP16_UnfusedOptimizer"}


def _ds_outcome(init: dict, snapshots: list[dict], cell, world: int) -> dict:
    """The worst window, each compared from the weights the run had when it started."""
    from zerofix.check import reference

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


def zero3_loss(job, rows, nproc, timeout, workdir, *, tied: bool = False):
    # a tied head (GPT-2, Qwen2) has no bias; the built-in rows' untied head has one
    cells = [{"name": r.name, "mode": r.name.rsplit("-", 1)[1], "tied": tied, "bias": not tied, "chunk_size": 3,
              "loss": "zerofix"} for r in rows]
    request = builders.zero3_loss_request(cells, nproc=nproc, timeout=timeout, name=job.name)

    def results(batch):
        import torch

        from zerofix.check import reference
        from zerofix.check.scenarios import zero3_loss as scenario

        records = batch.records(request)
        folder = batch.folder(request)
        init = torch.load(folder / "init.pt")
        out = {}
        for row, cell in zip(rows, cells, strict=True):
            errors = [r["cells"][cell["name"]].get("error") for r in records if r["cells"][cell["name"]].get("error")]
            if errors:
                out[row.name] = {"unpatched": None, "patched": {"error": errors[0]}, "applied": []}
                continue
            comparisons, before = [], init
            for step, after in enumerate(torch.load(folder / f"{cell['name']}.pt")):
                start, ref = scenario.reference_step(before, step, cell, nproc)
                comparisons.append(reference.compare(start, after, ref))
                before = after
            out[row.name] = {"unpatched": None, "applied": [],
                             "patched": _outcome(max(comparisons, key=lambda c: c["rel_err"]))}
        return out

    return Planned([request], results)


def trl_sft(job, rows, nproc, timeout, workdir):
    """SFTTrainer with loss_type="chunked_nll" unpatched and patched, against the same run whose loss is computed
    from the full logits (SFTTrainer's compute_loss_func): the outcome compares the train losses, grad norms and
    eval losses, step by step. TRL >= 1.6 computes every nll in chunks, so "nll" alone would compare TRL with itself."""
    model_dir = _tiny_llama(workdir)

    def sft(variant):
        loss_type = "nll" if variant == "reference" else "chunked_nll"
        args = ["--model-dir", str(model_dir), "--path", "r1", "--loss-type", loss_type]
        args += ["--loss-fn", "full-logits"] if variant == "reference" else []
        args += ["--zerofix"] if variant == "patched" else []
        return builders.trl_request(builders.TRL_SFT, f"{job.name}-{variant}", args, nproc=nproc, timeout=timeout,
                           late=variant == "unpatched")

    runs = {v: sft(v) for v in ("reference", "patched", "unpatched")}

    def results(batch):
        ref = batch.records(runs["reference"])
        if any("error" in r for r in ref):
            raise launch.LaunchError("the nll reference run failed", tail=_first_error(ref))
        got = {v: batch.records(runs[v]) for v in ("unpatched", "patched")}
        row = rows[0]
        return {row.name: {"unpatched": trl_outcome(got["unpatched"], ref), "patched": trl_outcome(got["patched"], ref),
                           "applied": _applied(got["patched"][0]["status"], row.fixes)}}

    return Planned(list(runs.values()), results)


def trl_sft_uneven(job, rows, nproc, timeout, workdir):
    """SFTTrainer, assistant-only masking that gives rank 0 one chunk and rank 1 three, TRL's chunked loss in a
    compute_loss that runs the decoder first (the scenario's ``r4``), against the same run with the full logits.
    The unpatched run hangs on TRL 1.6 - 1.14 (``_uneven_row``)."""
    model_dir = _tiny_llama(workdir)

    def sft(variant, **kw):
        loss_type = "nll" if variant == "reference" else "chunked_nll"
        args = ["--model-dir", str(model_dir), "--path", "r4", "--loss-type", loss_type]
        args += ["--zerofix"] if variant == "patched" else []
        return builders.trl_request(builders.TRL_SFT, f"{job.name}-{variant}", args, nproc=nproc, timeout=timeout, **kw)

    return _uneven_row(rows[0], sft, "the full-logits reference run failed")


def trl_distill_uneven(job, rows, nproc, timeout, workdir):
    """DistillationTrainer's own step, completions of different lengths on the ranks, 4 rows per chunk, against the
    same run with one chunk per rank (the full logits of the counted tokens). The unpatched run's collectives stop
    matching: gloo aborts, NCCL would hang (``_uneven_row``)."""
    from zerofix.check.scenarios import trl_distill as scenario

    student, teacher = workdir / "distill-models" / "student", workdir / "distill-models" / "teacher"  # the ranks make them

    def distill(variant, **kw):
        chunk = scenario.WHOLE if variant == "reference" else scenario.CHUNK
        args = ["--student", str(student), "--teacher", str(teacher), "--chunk", str(chunk)]
        args += ["--zerofix"] if variant == "patched" else []
        return builders.trl_request(builders.TRL_DISTILL, f"{job.name}-{variant}", args, nproc=nproc, timeout=timeout, **kw)

    return _uneven_row(rows[0], distill, "the one-chunk reference run failed")


def _uneven_row(row, request_of, reference_failed) -> Planned:
    """A row whose unpatched run may never finish: ``request_of(variant, **kw)`` for "reference", "patched" and
    "unpatched", which runs last with a limit of three times the patched run's time (at least 30 s). A hang (then
    every rank is killed) or gloo's abort on mismatched collectives is the unpatched result, said as such."""
    ref, patched = request_of("reference"), request_of("patched")
    unpatched = request_of("unpatched", late=True, bound=(patched, 3, 30.0))

    def results(batch):
        ref_records = batch.records(ref)
        if any("error" in r for r in ref_records):
            raise launch.LaunchError(reference_failed, tail=_first_error(ref_records))
        patched_records = batch.records(patched)
        try:
            got = trl_outcome(batch.records(unpatched), ref_records)
        except launch.LaunchError as exc:
            if "timed out" in str(exc):
                limit = max(30.0, 3 * batch.outcome(patched).seconds)
                got = {"error": f"hung: no result in {limit:.0f} s (3 x the patched run); the ranks were killed"}
            elif "collective mismatch" in f"{exc}\n{exc.tail}":
                got = {"error": "crash: the ranks' collectives did not match (gloo aborted; NCCL would hang)"}
            else:
                raise
        return {row.name: {"unpatched": got, "patched": trl_outcome(patched_records, ref_records),
                           "applied": _applied(patched_records[0]["status"], row.fixes)}}

    return Planned([ref, patched, unpatched], results)


def trl_grpo(job, rows, nproc, timeout, workdir):
    """GRPOTrainer, one SGD step per row from the same weights, unpatched and patched, against the update
    computed by hand in float64 from the inputs every micro-step received (scenario ``trl_grpo``)."""
    model_dir = _tiny_llama(workdir)
    cases = {r.name: GRPO_CASES[r.name] for r in rows}
    args = ["--model-dir", str(model_dir), "--cases", json.dumps(list(cases.values()))]
    variants = {v: builders.grpo_request(f"{job.name}-{v}", args, nproc=nproc, timeout=timeout, patched=v == "patched")
                for v in ("patched", "unpatched")}

    def results(batch):
        from zerofix.check import reference
        from zerofix.check.scenarios import trl_grpo as scenario

        out = {r.name: {} for r in rows}
        status = {}
        for variant, request in variants.items():
            records = batch.records(request)
            status[variant] = records[0]["status"]
            for row_name, case in cases.items():
                name = scenario.case_name(case)
                failed = next((r["cases"][name]["error"] for r in records if "error" in r["cases"][name]), None)
                if failed:
                    out[row_name][variant] = {"error": failed}
                    continue
                res = scenario.reference_update(model_dir, sorted(batch.folder(request).glob(f"{name}-rank*.pt")))
                out[row_name][variant] = _outcome(reference.compare_updates(res["got"], res["ref"]))
        patched_records = batch.records(variants["patched"])
        acted = {}  # the Trainer scaling names itself only where it changed a backward of the row's trainer
        for row_name, case in cases.items():
            details = [r["cases"][scenario.case_name(case)].get("scaling") for r in patched_records]
            acted[row_name] = any(d and d.get("corrected") for d in details)
        return {r.name: {**out[r.name], "applied": [f for f in _applied(status["patched"], r.fixes)
                                                    if f != "transformers-trainer-scaling" or acted[r.name]]}
                for r in rows}

    return Planned(list(variants.values()), results)


# zerofix check's GRPO rows: steps_per_generation above and below GAS (generation batches divisible by
# num_generations on 1 and 2 ranks)
GRPO_CASES = {
    "trl-grpo-dapo-spg4-gas2": {"loss_type": "dapo", "spg": 4, "gas": 2},
    "trl-grpo-dapo-spg2-gas4": {"loss_type": "dapo", "spg": 2, "gas": 4},
}


def _tiny_llama(workdir: Path) -> Path:
    """The folder of the TRL jobs' tiny Llama and tokenizer, which the first run that needs it makes
    (``scenarios.trl_sft.ensure``)."""
    return workdir / "tiny-llama"


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
# "tied": whether that model ties its head, "average_tokens": TrainingArguments.average_tokens_across_devices (None:
# the installed release's default)}


def _user_model(row_name: str, user: dict) -> str:
    """The model a row of a user's configuration trains: --model's (a causal LM's in every -causal-lm row, a
    sequence classifier's in the Trainer's -seq-cls row), a tiny Llama, or the custom module."""
    sequence = user.get("task") == "sequence"
    if row_name.endswith("-seq-cls"):
        return user["model"]
    if row_name.endswith("-causal-lm"):
        return "causal-lm" if sequence else user["model"]
    return "custom"


def your_trainer(job, rows, nproc, timeout, workdir, user):
    cfg = user["config"]
    cells = [{"name": model_of(r.name), "model": _user_model(r.name, user), "gas": cfg.gas, "bs": cfg.micro_batch,
              "samples": WINDOWS * cfg.gas * cfg.micro_batch * nproc, "clip": cfg.clip, "bf16": cfg.dtype == "bf16",
              "average_tokens": user["average_tokens"]} for r in rows]
    return trainer(job, rows, nproc, timeout, workdir, cells=cells, zero_stage=cfg.stage, ds_config=cfg.ds)


def your_accelerate(job, rows, nproc, timeout, workdir, user):
    cfg = user["config"]
    cells = [{"name": model_of(r.name), "model": _user_model(r.name, user), "gas": cfg.gas, "clip": cfg.clip,
              "samples": WINDOWS * cfg.gas * BATCH * nproc} for r in rows]
    return accelerate(job, rows, nproc, timeout, workdir, cells=cells, zero_stage=cfg.stage, ds_config=cfg.ds)


def user_ds_cell(name: str, cfg) -> accumulation.Cell:
    """deepspeed-manual: the loop accumulates ``cfg.manual_length`` micro-batches itself with config GAS=1;
    deepspeed-own: backward + step() per micro-batch at the configuration's GAS."""
    common = {"grad_clip": cfg.clip, "offload": cfg.offload == "cpu", "dtype": cfg.dtype}
    if name.endswith("-manual"):
        return accumulation.Cell(cfg.stage, 1, "a", length=cfg.manual_length, **common)
    return accumulation.Cell(cfg.stage, cfg.gas, "b", length=cfg.gas, **common)


def your_deepspeed(job, rows, nproc, timeout, workdir, user):
    cells = [user_ds_cell(r.name, user["config"]) for r in rows]
    return deepspeed(job, rows, nproc, timeout, workdir, cells=cells, base_config=user["config"].ds)


def your_zero3_loss(job, rows, nproc, timeout, workdir, user):
    return zero3_loss(job, rows, nproc, timeout, workdir, tied=user["tied"])


def trainer_sp(job, rows, nproc, timeout, workdir):
    """The Trainer under DeepSpeed Ulysses (``zerofix.check.scenarios.sequence_parallel``): one SP group of every rank, GA 2,
    samples whose counted labels split unevenly over the shards; compared with the window's token mean."""
    cells = [{"zero": int(r.name.rsplit("zero", 1)[1]), "gas": 2, "sp": nproc} for r in rows]
    request = builders.sp_request(cells, nproc=nproc, timeout=timeout, name=job.name)

    def results(batch):
        measured = [x for record in batch.records(request) for x in record.get("results", ())]
        out = {}
        for row, cell in zip(rows, cells, strict=True):
            runs = {m["variant"]: m for m in measured if m["zero"] == cell["zero"]}
            variant = {k: ({"error": v["error"]} if "error" in v else _outcome(v["token"])) for k, v in runs.items()}
            out[row.name] = {**variant, "applied": _applied(runs.get("patched", {}).get("status", {}), row.fixes)}
        return out

    return Planned([request], results)


PLANNERS = {"deepspeed": deepspeed, "trainer-sp": trainer_sp, "zero3-loss": zero3_loss, "trl-sft": trl_sft, "trl-sft-uneven": trl_sft_uneven,
            "trl-distill-uneven": trl_distill_uneven, "trl-grpo": trl_grpo}
USER_PLANNERS = {"your-trainer": your_trainer, "your-accelerate": your_accelerate, "your-deepspeed": your_deepspeed,
                 "your-zero3-loss": your_zero3_loss}


def planner(job):
    """The function that plans a job: by name, or by family (trainer-*, accelerate-*)."""
    return PLANNERS.get(job.name) or {"trainer": trainer, "accelerate": accelerate}[job.name.split("-", 1)[0]]


def your_model(job, rows, nproc, timeout, workdir, user):
    """``--model`` without ``--deepspeed`` (plan.model_setup): the built-in Trainer rows, training the user's model."""
    cells = [{"name": model_of(r.name), "model": user["model"], "gas": user["gas"],
              "samples": WINDOWS * user["gas"] * BATCH * nproc} for r in rows]
    return trainer(job, rows, nproc, timeout, workdir, cells=cells,
                   fsdp_config=user.get("fsdp_config") if job.fsdp else None)


def plan(job, rows, nproc: int, timeout: float, workdir: Path, user: dict | None = None) -> Planned:
    if job.name in USER_PLANNERS:
        return USER_PLANNERS[job.name](job, rows, nproc, timeout, Path(workdir), user)
    if user and "config" not in user and user.get("model") and job.name.startswith("trainer-"):
        return your_model(job, rows, nproc, timeout, Path(workdir), user)
    if job.fsdp and user and user.get("fsdp_config") is not None:  # --fsdp-config: the user's FSDP settings
        return trainer(job, rows, nproc, timeout, Path(workdir), fsdp_config=user["fsdp_config"])
    return planner(job)(job, rows, nproc, timeout, Path(workdir))
