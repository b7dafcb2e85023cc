"""Which engine and parallel layout a loss goes through, and whether a fix models it.

A fix's plan is right only for the path it was computed for (docs/fixes.md, "Paths"). Every entry acts on the
paths it models and stands aside elsewhere, saying "not covered: <path>" in the log and in ``zerofix status``:

- the Trainer's scaling (``transformers-trainer-scaling``) and accelerate's loop entries model one process, DDP
  (any ``MULTI_*`` device), DeepSpeed ZeRO-0..3 and accelerate's FSDP1 and FSDP2: on each of them
  ``Accelerator.backward`` divides by accelerate's steps (or DeepSpeed does, per ``scale_wrt_gas``) and the
  engine averages gradients over every process (read off accelerate 1.1.1 - 1.15.0 and transformers 4.46 - 5.23;
  FSDP measured through ``zerofix.check.fsdp_cpu``);
- the raw DeepSpeed entries model a data-parallel engine: every rank holds a different micro-batch.

- DeepSpeed Ulysses sequence parallelism under the Trainer (``parallelism_config`` with ``sp_backend="deepspeed"``) is
  modelled by ``transformers-deepspeed-sp-loss`` alone (``sequence_parallel_path``: what DeepSpeed's reduction divides
  the sum over every rank by); every other entry stands aside on it.

Not modelled, so not covered: tensor parallelism (``tp_plan`` / ``tp_size``, accelerate's ``parallelism_config``,
DeepSpeed AutoTP), context parallelism (``cp_size``), sequence parallelism elsewhere (``sp_size`` for the entries above,
a raw engine's ``sequence_parallel_size``), HSDP (replicated shards), torch ``DataParallel`` (``n_gpu > 1`` in one process), XLA,
Megatron-LM, and any distributed type accelerate adds later. On those, ranks share micro-batches or the loss is
split across ranks, and the count of processes is no longer the count of data-parallel replicas.

Plain code: reads attributes only, imports no ML library; ``stood_aside`` keeps what each fix declined, for
``zerofix status`` (tests/test_paths.py).
"""
from __future__ import annotations

from typing import NamedTuple

# accelerate's DistributedType values whose Accelerator.backward divides by its steps and calls loss.backward()
DATA_PARALLEL = frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                           "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"})


class Path(NamedTuple):
    name: str  # what runs: "one process", "DDP", "DeepSpeed ZeRO-2", "FSDP2", or the uncovered layout
    covered: bool

    def __str__(self) -> str:
        return self.name if self.covered else f"not covered: {self.name}"


def _value(enum_or_str) -> str:
    return str(getattr(enum_or_str, "value", enum_or_str))


def _size(obj, name: str) -> int:
    try:
        return int(getattr(obj, name, None) or 1)
    except (TypeError, ValueError):
        return 1


def _layout(parallelism_config) -> str | None:
    """The non-data-parallel layout of accelerate's ParallelismConfig, or None."""
    if parallelism_config is None:
        return None
    for attr, what in (("tp_size", "tensor parallel"), ("cp_size", "context parallel"),
                       ("sp_size", "sequence parallel")):
        size = _size(parallelism_config, attr)
        if size > 1:
            backend = getattr(parallelism_config, f"{attr[:2]}_backend", None)
            return f"{what} ({attr}={size}{f', {backend}' if backend else ''})"
    if _size(parallelism_config, "dp_replicate_size") > 1 and _size(parallelism_config, "dp_shard_size") > 1:
        return (f"HSDP (dp_replicate_size={_size(parallelism_config, 'dp_replicate_size')}, "
                f"dp_shard_size={_size(parallelism_config, 'dp_shard_size')})")
    return None


def _deepspeed_layout(config: dict) -> str | None:
    """Tensor or sequence parallelism in a DeepSpeed configuration, or None."""
    if not isinstance(config, dict):
        return None
    tp = config.get("tensor_parallel")
    autotp = int(tp.get("autotp_size", 1) or 1) if isinstance(tp, dict) else 1
    if autotp > 1:
        return f"DeepSpeed AutoTP tensor parallel (autotp_size={autotp})"
    sp = int(config.get("sequence_parallel_size", 1) or 1)
    if sp > 1:
        return f"DeepSpeed Ulysses sequence parallel (sequence_parallel_size={sp})"
    return None


def model_layout(model) -> str | None:
    """Tensor parallelism a model was loaded with (``from_pretrained(tp_plan="auto")``), or None."""
    for attr in ("_tp_size", "tp_size"):
        size = _size(model, attr) if model is not None else 1
        if size > 1:
            return f"tensor parallel (model {attr}={size})"
    return None


def accelerate_path(state, *, model=None, n_gpu: int = 1) -> Path:
    """The path of a loss through ``Accelerator.backward``: ``state`` is the Accelerator or its AcceleratorState;
    ``model`` the trained model (its own tensor parallel plan); ``n_gpu``: TrainingArguments.n_gpu (DataParallel)."""
    state = getattr(state, "state", state)
    kind = _value(getattr(state, "distributed_type", "NO"))
    layout = (_layout(getattr(state, "parallelism_config", None)) or model_layout(model)
              or (f"tensor parallel (torch_tp_plugin tp_size={_size(state.torch_tp_plugin, 'tp_size')})"
                  if _size(getattr(state, "torch_tp_plugin", None), "tp_size") > 1 else None))
    if layout is not None:
        return Path(layout, False)
    if kind == "DEEPSPEED":
        plugin = getattr(state, "deepspeed_plugin", None)
        ds_layout = _deepspeed_layout(getattr(plugin, "deepspeed_config", None))
        if ds_layout is not None:
            return Path(ds_layout, False)
        stage = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}).get("stage")
        return Path("DeepSpeed" + (f" ZeRO-{stage}" if stage is not None else ""), True)
    if kind == "FSDP":
        version = getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1)
        return Path(f"FSDP{version}", True)
    if kind in DATA_PARALLEL:
        if n_gpu > 1:
            return Path(f"torch DataParallel (n_gpu={n_gpu})", False)
        return Path("one process" if kind == "NO" else "DDP", True)
    return Path(f"accelerate DistributedType.{kind}", False)


def trainer_path(trainer) -> Path:
    """The path of a Trainer's loss."""
    try:
        n_gpu = int(trainer.args.n_gpu)
    except Exception:  # noqa: BLE001 - arguments without a device set-up: one device
        n_gpu = 1
    return accelerate_path(trainer.accelerator, model=getattr(trainer, "model", None), n_gpu=n_gpu)


def engine_path(engine) -> Path:
    """The path of a raw DeepSpeed engine: covered while it is data parallel only."""
    sp = _size(engine, "sequence_parallel_size")
    if sp > 1:
        return Path(f"DeepSpeed Ulysses sequence parallel (sequence_parallel_size={sp})", False)
    autotp = getattr(engine, "autotp_size", None)
    try:
        autotp = int(autotp()) if callable(autotp) else 1
    except Exception:  # noqa: BLE001 - a release whose autotp_size needs a config it lacks: no AutoTP
        autotp = 1
    if autotp > 1:
        return Path(f"DeepSpeed AutoTP tensor parallel (autotp_size={autotp})", False)
    stage = engine.zero_optimization_stage() if callable(getattr(engine, "zero_optimization_stage", None)) else "?"
    return Path(f"DeepSpeed ZeRO-{stage}", True)


# An entry that models a path the others do not, by the start of the path's name (paths.accelerate_path's, which the
# Trainer's log reads before any step): the Trainer under DeepSpeed Ulysses is transformers-deepspeed-sp-loss's alone
MODELS_ALONE = {"transformers-deepspeed-sp-loss": ("sequence parallel (sp_size=",)}

# Entries that check the path they run on and stand aside elsewhere (the Trainer's, DeepSpeed's and accelerate's);
# TRL's entries act inside TRL's own loss, on any path
PATH_AWARE = ("transformers", "deepspeed", "accelerate")


def stands_aside(fix_id: str, dist: str, path: Path) -> bool:
    """Whether an applied entry stands aside on ``path`` (issue 69: the log's first line named an entry as acting on a
    sequence-parallel run whose next line said it was not covered)."""
    if path.covered:
        return False
    if fix_id in MODELS_ALONE:
        return not path.name.startswith(MODELS_ALONE[fix_id])
    return dist in PATH_AWARE


# fix id -> the uncovered paths it stood aside on, in this process (for zerofix status)
_stood_aside: dict[str, list[str]] = {}


def stood_aside(fix_id: str, path: Path) -> bool:
    """Record that ``fix_id`` stood aside on ``path``; True the first time (the caller logs it once)."""
    seen = _stood_aside.setdefault(fix_id, [])
    if path.name in seen:
        return False
    seen.append(path.name)
    return True


def not_covered(fix_id: str) -> list[str]:
    return list(_stood_aside.get(fix_id, ()))


def reset() -> None:
    _stood_aside.clear()


def _called(obj, name, default=None):
    value = getattr(obj, name, None)
    try:
        return value() if callable(value) else default
    except Exception:  # noqa: BLE001 - a release whose accessor needs a config it lacks: the default
        return default


def sequence_parallel_path(trainer) -> tuple[Path, float]:
    """The Trainer's DeepSpeed Ulysses sequence-parallel path (``parallelism_config`` with ``sp_backend="deepspeed"``)
    and what DeepSpeed's gradient reduction divides the sum over every rank by, as read in DeepSpeed 0.18.2 - 0.19.8:
    ``world / sp`` on ZeRO-0/1/2 and ZeRO-3's contiguous buckets (``... / float(self.sequence_parallel_size)``), the
    world size on ZeRO-3's reduce-scatter (``reduce_scatter_coalesced`` pre-divides by the group's size). Covered
    (``transformers-deepspeed-sp-loss``) where that divisor is one number for every gradient: ZeRO-0/1/2, and ZeRO-3
    with reduce-scatter (its default); no gradient pre-division, no ``prescale_gradients``, no quantized gradients."""
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    sp = _size(pc, "sp_size")
    engine = getattr(trainer, "model_wrapped", None)
    stage = _called(engine, "zero_optimization_stage")
    name = f"DeepSpeed Ulysses sequence parallel (sp_size={sp}"
    world = _size(engine, "seq_dp_world_size")
    engine_sp = _size(engine, "sequence_parallel_size")
    if stage is None or engine_sp != sp or world % sp:
        return Path(f"{name}) on an engine zerofix cannot read", False), 1.0
    name += f", {world // sp} data-parallel) ZeRO-{stage}"
    if _size(pc, "tp_size") > 1 or _size(pc, "cp_size") > 1 or _size(pc, "dp_shard_size") > 1:
        return Path(f"{name} with tensor, context or sharded data parallelism", False), 1.0
    if not _called(engine, "postscale_gradients", True) or _called(engine, "gradient_predivide_factor", 1.0) != 1.0:
        return Path(f"{name} with prescale_gradients or a gradient_predivide_factor", False), 1.0
    if _called(engine, "zero_quantized_gradients", False):
        return Path(f"{name} with quantized gradients", False), 1.0
    if stage == 3:
        if not _called(engine, "zero_reduce_scatter", True):
            return Path(f"{name} without reduce_scatter (its buckets divide by either world or world / sp)",
                        False), 1.0
        return Path(name, True), float(world)
    return Path(name, True), float(world // sp)
