"""The plan of ``zerofix check``: its scenarios as data (what each row trains, which job runs it, which catalogue
entries concern it), the rows a run selects, the reason each row that cannot run is skipped, and a user's own
configuration (``--deepspeed``) turned into rows. ``make`` returns the ``Plan`` that ``zerofix.check.measure`` runs:
every row of every job in one batch (one session of ranks per rank count)."""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import NamedTuple

from zerofix.check.accumulation import BF16_BOUND
from zerofix.versions import installed_version, version_in_range

TRAINER_FIXES = ("transformers-trainer-scaling",)
MOE_FIXES = ("transformers-trainer-scaling", "transformers-moe-aux-loss")
# accelerate's FSDP2 through the Trainer: measured from accelerate 1.10.1 (zerofix.check.fsdp_cpu on CPU)
FSDP2_VERSIONS = (("accelerate", ">=1.10.1", "is older than the FSDP2 scenario (accelerate >= 1.10.1)"),)
TRAINER_DS_FIXES = ("transformers-trainer-scaling", "deepspeed-scale-wrt-gas", "deepspeed-zero12-accumulator")
SP_FIXES = ("transformers-deepspeed-sp-loss", "deepspeed-scale-wrt-gas")
DS_MANUAL_FIXES = ("deepspeed-manual-accumulation", "deepspeed-zero12-accumulator")
# not deepspeed-scale-wrt-gas: it changes only a backward given scale_wrt_gas=False, which DeepSpeed's own loop
# never passes (the Trainer does: TRAINER_DS_FIXES)
DS_OWN_FIXES = ("deepspeed-zero12-accumulator",)


class Job(NamedTuple):
    name: str
    requires: tuple[str, ...]  # distributions that must be installed
    ranks: str = "n"  # "n": --nproc ranks; "1": always one process
    min_ranks: int = 1  # skipped below this many ranks (DDP needs 2)
    versions: tuple[tuple[str, str, str], ...] = ()  # (dist, PEP 440 specifier, why) that must hold
    zero_stage: int | None = None  # trainer / accelerate jobs: through DeepSpeed with this stage
    fsdp: int | None = None  # trainer jobs: through accelerate's FSDP of this version


class Scenario(NamedTuple):
    name: str
    job: str
    title: str
    fixes: tuple[str, ...] = ()  # catalogue entries that concern this scenario ("fixed by" names them)
    quick: bool = False  # in ``--quick``'s set
    patchable: bool = True  # False: an API with nothing to patch; only the zerofix run is made
    tolerance: float | None = None  # None: verdict.TOLERANCE


JOBS = {job.name: job for job in (
    Job("trainer-1proc", ("transformers", "accelerate"), ranks="1"),
    Job("trainer-ddp", ("transformers", "accelerate"), min_ranks=2),
    Job("trainer-fsdp2", ("transformers", "accelerate"), versions=FSDP2_VERSIONS, fsdp=2),
    Job("trainer-zero2", ("transformers", "accelerate", "deepspeed"), zero_stage=2),
    Job("trainer-zero3", ("transformers", "accelerate", "deepspeed"), zero_stage=3),
    # DeepSpeed Ulysses through the Trainer's parallelism_config (zerofix.check.scenarios.sequence_parallel): every rank one SP
    # group; transformers' SP branch is 5.0+, accelerate's sp_backend 1.12+, which requires DeepSpeed 0.18.2+
    Job("trainer-sp", ("transformers", "accelerate", "deepspeed"), min_ranks=2, versions=(
        ("transformers", ">=5.0.0.dev0", "has no DeepSpeed sequence-parallel branch (5.0+)"),
        ("accelerate", ">=1.12.0", "has no sp_backend (1.12+)"),
        ("deepspeed", ">=0.18.2", "is older than accelerate's Ulysses (0.18.2+)"))),
    Job("accelerate-ddp", ("transformers", "accelerate"), min_ranks=2),
    Job("accelerate-zero2", ("transformers", "accelerate", "deepspeed"), zero_stage=2),
    Job("deepspeed", ("deepspeed",)),
    Job("zero3-loss", ("deepspeed",)),
    Job("trl-sft", ("trl", "transformers", "accelerate", "deepspeed", "datasets"),
        versions=(("trl", ">=1.4.0", "has no loss_type='chunked_nll' (new in 1.4.0)"),)),
    Job("trl-sft-uneven", ("trl", "transformers", "accelerate", "deepspeed", "datasets"), min_ranks=2,
        versions=(("trl", ">=1.4.0,<1.15.0", "has no _chunked_cross_entropy_loss (1.4.0 - 1.14.x; from 1.15.0 "
                   "chunked_nll is nll)"),)),
    Job("trl-distill-uneven", ("trl", "transformers", "accelerate", "deepspeed", "datasets"), min_ranks=2,
        versions=(("trl", ">=1.10.0,<1.15.0", "has no chunked divergence loop (DistillationTrainer, 1.10.0 - "
                   "1.14.x)"),)),
    Job("trl-grpo", ("trl", "transformers", "accelerate", "datasets", "requests"),
        versions=(("trl", ">=1.0.0", "is older than the GRPO scenario (trl >= 1.0.0)"),)),
)}

_LM_MODELS = {"causal-lm": "causal LM with loss kwargs", "custom": "custom module without loss kwargs"}
# the Trainer's rows also train a head whose forward takes **kwargs but whose loss ignores num_items_in_batch
_MODELS = {**_LM_MODELS, "seq-cls": "Llama sequence classifier (loss ignores num_items_in_batch)"}
SCENARIOS: tuple[Scenario, ...] = (
    *(Scenario(f"trainer-1proc-{m}", "trainer-1proc", f"Trainer, GAS=8, 1 process, {d}", TRAINER_FIXES, quick=True)
      for m, d in _MODELS.items()),
    *(Scenario(f"trainer-ddp-{m}", "trainer-ddp", f"Trainer, GAS=8, DDP, {d}", TRAINER_FIXES)
      for m, d in _MODELS.items()),
    Scenario("trainer-1proc-moe", "trainer-1proc", "Trainer, GAS=8, 1 process, Mixtral MoE (router auxiliary loss)",
             MOE_FIXES),
    *(Scenario(f"trainer-fsdp2-{m}", "trainer-fsdp2", f"Trainer, GAS=8, FSDP2 (accelerate), {d}", TRAINER_FIXES)
      for m, d in _MODELS.items() if m != "custom"),
    *(Scenario(f"trainer-zero{s}-{m}", f"trainer-zero{s}", f"Trainer, GAS=8, DeepSpeed ZeRO-{s}, {d}", TRAINER_DS_FIXES)
      for s in (2, 3) for m, d in _MODELS.items()),
    *(Scenario(f"trainer-sp-zero{s}", "trainer-sp", f"Trainer, GAS=2, DeepSpeed Ulysses sequence parallel (sp_size = "
               f"ranks), ZeRO-{s}, tiny Llama, uneven counts over the shards", SP_FIXES) for s in (2, 3)),
    *(Scenario(f"accelerate-ddp-{m}", "accelerate-ddp", f"Accelerate accumulate(), GAS=4, DDP, {d}")
      for m, d in _LM_MODELS.items()),
    *(Scenario(f"accelerate-zero2-{m}", "accelerate-zero2", f"Accelerate accumulate(), GAS=4, DeepSpeed ZeRO-2, {d}",
               ("deepspeed-zero12-accumulator", "deepspeed-output-hook-division", "accelerate-deepspeed-no-sync"))
      for m, d in _LM_MODELS.items()),
    *(Scenario(f"deepspeed-zero{s}-manual", "deepspeed", f"raw DeepSpeed ZeRO-{s}, config GAS=1, 4 x backward then "
               "step()", DS_MANUAL_FIXES, quick=s == 2) for s in (1, 2, 3)),
    *(Scenario(f"deepspeed-zero{s}-own", "deepspeed", f"raw DeepSpeed ZeRO-{s}, config GAS=4, backward + step() "
               "per micro-batch", DS_OWN_FIXES, quick=s == 2) for s in (1, 2, 3)),
    *(Scenario(f"deepspeed-zero{s}-offload-manual", "deepspeed", f"raw DeepSpeed ZeRO-{s} + CPU optimizer offload, "
               "config GAS=1, 4 x backward then step()", ("deepspeed-manual-accumulation",)) for s in (1, 2)),
    Scenario("deepspeed-zero2-offload-own", "deepspeed", "raw DeepSpeed ZeRO-2 + CPU optimizer offload, config GAS=4, "
             "backward + step() per micro-batch", ("deepspeed-offload-accumulator",)),
    # DeepSpeed's BF16_Optimizer: bf16 with an fp32 gradient accumulator (data_types.grad_accum_dtype); FP16_UnfusedOptimizer
    # on 0.17.6 - 0.18.4
    Scenario("deepspeed-zero1-bf16-own", "deepspeed", "raw DeepSpeed ZeRO-1, bf16 + fp32 gradient accumulator, config "
             "GAS=4, backward + step() per micro-batch", ("deepspeed-bf16-boundary-reduction", "deepspeed-bf16-loss-scale"),
             tolerance=BF16_BOUND),
    # ZeRO-0 in bf16: FP16_UnfusedOptimizer from 0.17.6
    Scenario("deepspeed-zero0-bf16-own", "deepspeed", "raw DeepSpeed ZeRO-0, bf16, config GAS=4, backward + step() per "
             "micro-batch", ("deepspeed-bf16-loss-scale",), tolerance=BF16_BOUND),
    *(Scenario(f"zero3-loss-{where}", "zero3-loss", f"zerofix.chunked_cross_entropy on a ZeRO-3 head, {where} "
               "engine.forward", patchable=False) for where in ("inside", "outside")),
    # Compared with the same SFTTrainer run with loss_type="nll" (full logits): losses and grad norms.
    Scenario("trl-sft-chunked-nll", "trl-sft", "TRL SFTTrainer, loss_type=chunked_nll, ZeRO-3, with evaluation",
             ("trl-chunked-nll-zero3",), tolerance=1e-5),
    Scenario("trl-sft-uneven-chunks", "trl-sft-uneven", "TRL SFTTrainer, chunked loss in a compute_loss, ZeRO-3, "
             "assistant-only masking: 1 chunk on rank 0, 3 on rank 1", ("trl-chunked-nll-zero3",
             "trl-chunked-nll-gather-zero3"), tolerance=1e-5),
    Scenario("trl-distill-uneven-chunks", "trl-distill-uneven", "TRL DistillationTrainer, ZeRO-3, on-policy, "
             "completions ending at EOS: different chunk counts on the ranks", ("trl-distillation-chunked-gather-zero3",),
             tolerance=1e-5),
    # One SGD step against the float64 update from the inputs every micro-step received.
    *(Scenario(f"trl-grpo-dapo-spg{spg}-gas{gas}", "trl-grpo", f"TRL GRPOTrainer, loss_type=dapo, "
               f"steps_per_generation={spg}, GAS={gas}", ("trl-grpo-window-normalisation",) + TRAINER_FIXES,
               tolerance=1e-5)
      for spg, gas in ((4, 2), (2, 4))),
)
NAMES = tuple(s.name for s in SCENARIOS)


# ``zerofix check --deepspeed FILE``: the scenarios that concern a user's configuration, trained with it
# (zerofix.check.userconfig resolves it; zerofix.check.jobs' your_* runners run them).
USER_JOBS = {job.name: job for job in (
    Job("your-trainer", ("transformers", "accelerate", "deepspeed")),
    Job("your-accelerate", ("transformers", "accelerate", "deepspeed")),
    Job("your-deepspeed", ("deepspeed",)),
    Job("your-zero3-loss", ("deepspeed",)),
)}
BF16_TOLERANCE = BF16_BOUND  # 16 bf16 rounding units


def job(name: str) -> Job:
    """A built-in job or a user configuration's job, by name."""
    return JOBS.get(name) or USER_JOBS[name]


def user_scenarios(cfg, *, model_name: str | None = None, tied: bool = False, task: str = "token",
                   moe_model: bool = False) -> list[Scenario]:
    """The rows for a user's configuration ``cfg`` (a zerofix.check.userconfig.UserConfig). ``model_name``:
    the class of ``--model``'s tiny model (the Trainer and accelerate rows train it; without it, a tiny Llama
    and, for the Trainer, a custom module without loss kwargs); ``tied``: whether its head is tied; ``task``:
    "sequence" for a sequence classifier (the Trainer's row trains it, the accelerate row a tiny Llama)."""
    tolerance = BF16_TOLERANCE if cfg.dtype == "bf16" else None
    lm = model_name if model_name and task != "sequence" else "tiny Llama"
    # ZeRO-1 in bf16 with an fp32 gradient accumulator trains through DeepSpeed's BF16_Optimizer (0.18.5+), and through
    # FP16_UnfusedOptimizer on 0.17.6 - 0.18.4, as ZeRO-0 in bf16 does from 0.17.6
    bf16_accumulator = (cfg.dtype == "bf16" and cfg.stage == 1 and not cfg.offload
                        and cfg.ds.get("data_types", {}).get("grad_accum_dtype") is not None)
    bf16 = ("deepspeed-bf16-boundary-reduction", "deepspeed-bf16-loss-scale") if bf16_accumulator else ()
    if cfg.dtype == "bf16" and cfg.stage == 0:
        bf16 = ("deepspeed-bf16-loss-scale",)
    engine = (("deepspeed-offload-accumulator",) if cfg.offload == "cpu" else ()) + bf16  # what every row's engine is
    if task == "sequence":
        rows = [Scenario("trainer-seq-cls", "your-trainer", f"Trainer, your config, {model_name}",
                         TRAINER_DS_FIXES + engine, tolerance=tolerance)]
    else:
        moe = ("transformers-moe-aux-loss",) if moe_model else ()
        rows = [Scenario("trainer-causal-lm", "your-trainer", f"Trainer, your config, {lm}"
                         + (" (router auxiliary loss)" if moe_model else ""), TRAINER_DS_FIXES + moe + engine,
                         tolerance=tolerance)]
    if model_name is None:
        rows.append(Scenario("trainer-custom", "your-trainer", "Trainer, your config, custom module without loss kwargs",
                             TRAINER_DS_FIXES + engine, tolerance=tolerance))
    rows += [
        Scenario("accelerate-causal-lm", "your-accelerate", f"Accelerate accumulate(), your config, {lm}",
                 ("deepspeed-zero12-accumulator", "deepspeed-output-hook-division", "accelerate-deepspeed-no-sync")
                 + engine, tolerance=tolerance),
        Scenario("deepspeed-manual", "your-deepspeed", f"raw engine, your config with GAS=1, {cfg.manual_length} x backward then "
                 "step()", DS_MANUAL_FIXES + bf16, tolerance=tolerance),
        Scenario("deepspeed-own", "your-deepspeed", f"raw engine, your config (GAS={cfg.gas}), backward + step() per "
                 "micro-batch", DS_OWN_FIXES + engine, tolerance=tolerance),
    ]
    if cfg.stage == 3:
        rows += [Scenario(f"zero3-loss-{where}", "your-zero3-loss", f"zerofix.chunked_cross_entropy, "
                          f"{'tied' if tied else 'untied'} ZeRO-3 head, {where} engine.forward", patchable=False)
                 for where in ("inside", "outside")]
    return rows


class UsageError(ValueError):
    pass


# TrainingArguments.fsdp_config's keys (transformers 4.57 - 5.23, an "fsdp_" prefix allowed), for naming a typo
FSDP_CONFIG_KEYS = ("version", "min_num_params", "transformer_layer_cls_to_wrap", "auto_wrap_policy",
                    "backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params",
                    "sync_module_states", "cpu_ram_efficient_loading", "activation_checkpointing", "cpu_offload",
                    "offload_params", "state_dict_type", "reshard_after_forward", "sharding_strategy", "xla",
                    "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")


def fsdp_setup(path) -> dict:
    """A user's fsdp_config file (``--fsdp-config``), checked: a JSON object of known keys, version 2. Raises
    UsageError naming what is wrong (and, for an unknown key, the nearest known one)."""
    import difflib
    import json

    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"--fsdp-config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--fsdp-config {path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--fsdp-config {path}: a JSON object of fsdp_config keys is needed, not {type(config).__name__}")
    for key in config:
        bare = key[5:] if key.startswith("fsdp_") else key
        if bare not in FSDP_CONFIG_KEYS:
            near = difflib.get_close_matches(bare, FSDP_CONFIG_KEYS, n=1)
            raise UsageError(f"--fsdp-config {path}: unknown key {key!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else f"; the keys are {', '.join(FSDP_CONFIG_KEYS)}"))
    version = int(config.get("version", config.get("fsdp_version", 2)))
    if version != 2:
        raise UsageError(f"--fsdp-config {path}: version {version}: FSDP1 does not run on CPU (torch's device checks); "
                         "the GPU tier measures it (tools/gpu_trainer_matrix.py)")
    return {"fsdp_config": config}


def select(*, only=None, skip=None, quick: bool = False, rows=None) -> list[Scenario]:
    """The scenarios to run, from ``rows`` (default: the built-in SCENARIOS). ``only`` / ``skip``: names or
    shell patterns (``deepspeed-*``); every pattern must match a scenario. ``only`` picks from every scenario;
    otherwise ``quick`` picks its small set."""
    rows = SCENARIOS if rows is None else rows
    names = [s.name for s in rows]

    def matching(patterns):
        picked = set()
        for pattern in patterns:
            hits = fnmatch.filter(names, pattern)
            if not hits:
                raise UsageError(f"no scenario matches {pattern!r}; the scenarios are: {', '.join(names)}")
            picked.update(hits)
        return picked

    chosen = matching(only) if only else {s.name for s in rows if s.quick or not quick}
    chosen -= matching(skip or ())
    return [s for s in rows if s.name in chosen]


class Plan(NamedTuple):
    """The rows a check runs, in the order it reports them; ``skipped``: row name -> why it cannot run here;
    ``user``: a user's configuration (``user_setup``) the rows train with, or None."""

    rows: list
    skipped: dict
    nproc: int
    user: dict | None = None

    def ranks(self, job_name: str) -> int:
        return 1 if job(job_name).ranks == "1" else self.nproc


def make(rows, nproc: int, found: dict, user: dict | None = None) -> Plan:
    unreproducible = user["config"].unreproducible if user and "config" in user else ()
    skipped = {}
    for row in rows:
        reason = skip_reason(job(row.job), nproc, found, unreproducible)
        if reason:
            skipped[row.name] = reason
    return Plan(list(rows), skipped, nproc, user)


def skip_reason(job: Job, nproc: int, found: dict, unreproducible=()) -> str | None:
    if unreproducible:
        return "not reproducible on CPU: " + "; ".join(unreproducible)
    # every scenario trains with torch (and its launcher is torch's)
    missing = [d for d in ("torch", *job.requires) if not (found.get(d) or installed_version(d))]
    if missing:
        return f"{', '.join(missing)} not installed"
    for dist, spec, why in job.versions:
        version = found.get(dist) or installed_version(dist)
        if not version_in_range(version, spec):
            return f"{dist} {version} {why}"
    ranks = 1 if job.ranks == "1" else nproc
    if ranks < job.min_ranks:
        return f"needs {job.min_ranks} ranks (--nproc {nproc})"
    if job.name == "trainer-sp" and _sp_loss_needs_a_missing_mesh():
        return ("transformers' SP loss reads accelerator.torch_device_mesh['sp'], which this accelerate does not "
                "build for DeepSpeed SP: every SP step stops at its first loss, unpatched and patched")
    return None


def _sp_loss_needs_a_missing_mesh() -> bool:
    """transformers 5.0 - 5.x's SP loss takes its group from ``accelerator.torch_device_mesh["sp"]`` only; accelerate
    1.13+ builds no device mesh for DeepSpeed SP. Read in the installed sources (no import: the plan stays cheap);
    measured on transformers 5.3 / accelerate 1.13 (tests/test_trainer_sequence_parallel.py)."""
    import importlib.util

    def text(module: str, file: str) -> str:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return ""
        path = Path(list(spec.submodule_search_locations)[0]) / file
        return path.read_text(errors="replace") if path.exists() else ""

    loss = text("transformers", "integrations/deepspeed.py") + text("transformers", "trainer.py")
    mesh = text("accelerate", "parallelism_config.py")
    reads_mesh = 'torch_device_mesh["sp"]' in loss and "_get_sequence_parallel_group" not in loss
    return reads_mesh and 'self.sp_backend == "deepspeed" and self.sp_size > 1:\n            return None' in mesh


def model_setup(model_path, *, workdir: Path, gas=None, fsdp_config=None) -> dict:
    """``zerofix check --model PATH`` without ``--deepspeed`` (issue 59, item 4): the user's model class as a tiny random
    instance, trained by the Trainer on one process and with DDP (and FSDP2 with ``--fsdp-config``), unpatched and
    patched against the reference: for a head the Trainer never hands the count, its mean-of-means row. Raises
    userconfig.ConfigError for a model that cannot be built."""
    from zerofix.check import userconfig, usermodel
    from zerofix.check.jobs import TRAINER_GAS

    if not installed_version("transformers") or not installed_version("torch"):
        raise userconfig.ConfigError("--model builds a transformers model: install torch and transformers")
    model, described = usermodel.prepare(model_path, workdir / "model")
    task, name = described["task"], described["class"]
    suffix = "seq-cls" if task == "sequence" else "causal-lm"
    fixes = MOE_FIXES if described.get("moe") else TRAINER_FIXES
    gas = gas or TRAINER_GAS
    jobs = [("trainer-1proc", "1 process"), ("trainer-ddp", "DDP")] + ([("trainer-fsdp2", "FSDP2 (accelerate)")]
                                                                       if fsdp_config else [])
    rows = [Scenario(f"{job}-{suffix}", job, f"Trainer, GAS={gas}, {where}, your {name}", fixes) for job, where in jobs]
    return {"model": model, "described": described, "task": task, "tied": described["tied_head"], "gas": gas,
            "rows": rows, "fsdp_config": fsdp_config["fsdp_config"] if fsdp_config else None}


def user_setup(deepspeed, *, nproc: int, workdir: Path, gas=None, bf16=False, fp16=False, trainer_args=None,
               model_path=None) -> dict:
    """Resolve a user's DeepSpeed config file (``--deepspeed``, with ``--gas``, ``--bf16``, ``--fp16``,
    ``--trainer-args`` and ``--model``): the configuration, the model the rows train, and the rows. Raises
    userconfig.ConfigError for anything unusable."""
    from zerofix.check import userconfig

    cfg = userconfig.load(deepspeed, gas=gas, nproc=nproc, bf16=bf16, fp16=fp16, trainer_args=trainer_args)
    described, model, tied = None, "causal-lm", False
    if model_path:
        if not installed_version("transformers") or not installed_version("torch"):
            raise userconfig.ConfigError("--model builds a transformers model: install torch and transformers")
        from zerofix.check import usermodel

        model, described = usermodel.prepare(model_path, workdir / "model")
        tied = described["tied_head"]
    task = described["task"] if described else "token"
    rows = user_scenarios(cfg, model_name=described and described["class"], tied=tied, task=task,
                          moe_model=bool(described and described.get("moe")))
    return {"config": cfg, "model": model, "tied": tied, "described": described, "task": task,
            # None: the installed release's default, as the user's run gets it (the ranks' TrainingArguments say which)
            "average_tokens": cfg.average_tokens, "rows": rows}


