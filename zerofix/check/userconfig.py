"""``zerofix check --deepspeed FILE``: the user's own DeepSpeed configuration (and, with ``--trainer-args``,
the Trainer's arguments), resolved as the Trainer resolves its ``"auto"`` values, plus what of it the check
cannot reproduce on CPU. Pure Python (no torch): a bad file is a usage error before anything launches.

What the check changes, and why (each change is listed in ``UserConfig.notes`` and printed):
- the ``optimizer`` and ``scheduler`` sections are left out: every scenario trains with torch SGD at a
  constant rate, the optimizer its float64 reference repeats; the bugs are in the gradient, before it;
- with CPU optimizer offload, ``zero_force_ds_cpu_optimizer: false`` (DeepSpeedCPUAdam is not the reference's
  optimizer);
- ``steps_per_print`` is made large (quiet ranks), ``zero_allow_untested_optimizer`` true (a torch optimizer).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

from zerofix.versions import installed_version, version_in_range

# The hidden size of every model the check builds (zerofix.check.models, and --model's shrunk copy): what the
# Trainer's hidden-size "auto" values are computed from.
HIDDEN = 32
DEFAULT_GAS = 4
DEFAULT_MICRO_BATCH = 2
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
# TrainingArguments fields that change the scaling of the gradient or the batches (the rest is ignored)
TRAINER_FIELDS = ("gradient_accumulation_steps", "per_device_train_batch_size", "max_grad_norm",
                  "average_tokens_across_devices", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration the check cannot use; the message names the file, the key and the fix."""


class UserConfig(NamedTuple):
    path: str
    ds: dict  # the configuration the scenarios train with: every "auto" resolved, the changes above made
    stage: int
    gas: int
    micro_batch: int
    clip: float  # the gradient clipping DeepSpeed applies (0: none)
    dtype: str  # fp32 | bf16 | fp16
    offload: str | None  # the optimizer offload device (cpu, nvme) or None
    average_tokens: bool | None  # TrainingArguments.average_tokens_across_devices (None: the release's default)
    notes: tuple[str, ...]  # what the check changed in the configuration, and why
    unreproducible: tuple[str, ...]  # what a CPU run cannot reproduce: the rows are skipped with this text

    @property
    def manual_length(self) -> int:
        """Micro-batches a manual-accumulation loop gathers per step(): the GAS (4 when the GAS is 1)."""
        return self.gas if self.gas > 1 else 4

    def summary(self) -> str:
        parts = [f"ZeRO-{self.stage}", f"GAS {self.gas}", f"micro-batch {self.micro_batch}", self.dtype]
        parts.append(f"clipping {self.clip:g}" if self.clip else "no clipping")
        if self.offload:
            parts.append(f"optimizer offload to {self.offload}")
        zero = self.ds.get("zero_optimization", {})
        parts += [k for k in ("overlap_comm", "contiguous_gradients") if zero.get(k) is True]
        return ", ".join(parts)


# Keys DeepSpeed reads that no source file of it spells as a string literal (it builds them from parts)
_MORE_KEYS = ("compile", "timers", "weight_quantization", "fp8")


def _deepspeed_words() -> frozenset:
    """The lower-case identifiers DeepSpeed's configuration code spells as string literals: the keys it reads."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    root = Path(next(iter(spec.submodule_search_locations)))
    words = set(_MORE_KEYS)
    for file in [*root.glob("*.py"), *root.glob("runtime/*.py"), *root.glob("runtime/*/*.py"),
                 *root.glob("monitor/*.py"), *root.glob("profiling/*.py"), *root.glob("comm/*.py")]:
        try:
            words.update(re.findall(r"[\"']([a-z][a-z0-9_]{2,})[\"']", file.read_text(errors="ignore")))
        except OSError:
            continue
    return frozenset(words)


def _zero_fields() -> frozenset:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the check runs on CPU; named, DeepSpeed does not warn
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception:  # noqa: BLE001 - no DeepSpeed, or one that cannot be imported here: DeepSpeed will say
        return frozenset()
    fields = getattr(DeepSpeedZeroConfig, "model_fields", None) or getattr(DeepSpeedZeroConfig, "__fields__", {})
    return frozenset(fields) | {getattr(f, "alias", None) for f in fields.values()} - {None}


def unknown_keys(ds: dict) -> list[str]:
    """A key DeepSpeed would ignore or refuse, named with the nearest key it knows (issue 42): a top-level key
    that is a near miss of one DeepSpeed reads (it ignores those silently: "zero_optimisation" left the check
    certifying a ZeRO-0 run), and a ``zero_optimization`` key its configuration model forbids."""
    import difflib

    problems = []
    known = _deepspeed_words()
    for key in ds if known else ():
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
            if near:
                problems.append(f"unknown key {key!r} (did you mean {near[0]!r}?): DeepSpeed would ignore it")
    zero = ds.get("zero_optimization")
    fields = _zero_fields() if isinstance(zero, dict) else frozenset()
    for key in zero if fields else ():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            problems.append(f"unknown key zero_optimization.{key!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else "") + ": DeepSpeed refuses it")
    return problems


def _read_json(path, option: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{option} {path}: no such file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        hint = ("the DeepSpeed config file your run passes to the Trainer or the launcher" if option == "--deepspeed"
                else "what TrainingArguments.to_json_string() writes")
        raise ConfigError(f"{option} {path}: not valid JSON ({exc.msg}, line {exc.lineno}, column {exc.colno}); "
                          f"give {hint}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{option} {path}: a JSON object is expected, found {type(data).__name__}")
    return data


def trainer_arguments(path) -> dict:
    """The fields of a TrainingArguments JSON (``TrainingArguments.to_json_string()``, or a hand-written
    subset) that change the scaling: the others are ignored."""
    if str(path).endswith(".bin"):
        raise ConfigError(f"--trainer-args {path}: training_args.bin is a pickle, which the check does not load; "
                          "write the JSON with TrainingArguments.to_json_string() (or a file with "
                          f"{', '.join(TRAINER_FIELDS)})")
    data = _read_json(path, "--trainer-args")
    return {k: data[k] for k in TRAINER_FIELDS if data.get(k) is not None}


def _is_auto(value) -> bool:
    return value == "auto"


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer or \"auto\", found {value!r}")
    return value


def load(path, *, gas: int | None = None, nproc: int = 2, bf16: bool = False, fp16: bool = False,
         trainer_args=None, deepspeed_version: str | None = None) -> UserConfig:
    """Read and resolve ``path`` (a DeepSpeed JSON config) for a run on ``nproc`` ranks. ``gas``, ``bf16`` and
    ``fp16`` are the command line's; ``trainer_args``: a TrainingArguments JSON file. Raises ConfigError."""
    raw = _read_json(path, "--deepspeed")
    misspelt = unknown_keys(raw)
    if misspelt:
        raise ConfigError(f"--deepspeed {path}: " + "; ".join(misspelt))
    args = trainer_arguments(trainer_args) if trainer_args else {}
    ds = copy.deepcopy(raw)
    notes, unreproducible = [], []
    where = f"--deepspeed {path}"

    # GAS: the command line, else the Trainer's arguments, else the config's number; they must agree, as the
    # Trainer makes them (HfTrainerDeepSpeedConfig.fill_match refuses a mismatch).
    config_gas = ds.get("gradient_accumulation_steps", "auto")
    if gas is not None and args.get("gradient_accumulation_steps") not in (None, gas):
        raise ConfigError(f"--gas {gas} but --trainer-args says gradient_accumulation_steps="
                          f"{args['gradient_accumulation_steps']}: give one of them")
    chosen = gas or args.get("gradient_accumulation_steps")
    if not _is_auto(config_gas):
        config_gas = _positive_int(config_gas, f"{where}: gradient_accumulation_steps")
        if chosen is not None and chosen != config_gas:
            raise ConfigError(f"{where} sets gradient_accumulation_steps={config_gas} but the run uses {chosen}: the "
                              "Trainer refuses this mismatch; set it to \"auto\" or to the same number")
        chosen = config_gas
    resolved_gas = _positive_int(chosen or DEFAULT_GAS, "--gas")

    config_mb = ds.get("train_micro_batch_size_per_gpu", "auto")
    micro_batch = args.get("per_device_train_batch_size")
    if not _is_auto(config_mb):
        config_mb = _positive_int(config_mb, f"{where}: train_micro_batch_size_per_gpu")
        if micro_batch is not None and micro_batch != config_mb:
            raise ConfigError(f"{where} sets train_micro_batch_size_per_gpu={config_mb} but --trainer-args says "
                              f"per_device_train_batch_size={micro_batch}: set it to \"auto\" or to the same number")
        micro_batch = config_mb
    micro_batch = _positive_int(micro_batch or DEFAULT_MICRO_BATCH, "per_device_train_batch_size")
    total = ds.get("train_batch_size", "auto")
    if not _is_auto(total) and total != micro_batch * resolved_gas * nproc:
        raise ConfigError(f"{where} sets train_batch_size={total}, but micro-batch {micro_batch} x GAS {resolved_gas} x "
                          f"{nproc} ranks is {micro_batch * resolved_gas * nproc}: set it to \"auto\" or pass --nproc/--gas "
                          "as your run has them")

    # Clipping: "auto" takes max_grad_norm (the Trainer's default is 1.0); absent, DeepSpeed's own default.
    clip = ds.get("gradient_clipping")
    if _is_auto(clip):
        clip = float(args.get("max_grad_norm", 1.0))
    elif clip is None:
        version = deepspeed_version or installed_version("deepspeed")
        clip = 1.0 if version and version_in_range(version, ">=0.19.0") else 0.0
        notes.append(f"no gradient_clipping: DeepSpeed {version or '?'}'s default, {clip:g}")
    clip = float(clip)

    dtype = "fp32"
    for name, flag in (("bf16", bf16 or bool(args.get("bf16"))), ("fp16", fp16 or bool(args.get("fp16")))):
        # absent, the section follows the run's flag (accelerate's set_mixed_precision adds it)
        enabled = (ds.get(name) or {}).get("enabled", False) if name in ds else "auto"
        if _is_auto(enabled):
            enabled = flag
        elif flag and not enabled:
            raise ConfigError(f"--{name} but {where} has {name}.enabled false: the Trainer refuses the mismatch; "
                              f"set {name}.enabled to \"auto\" or true")
        if name in ds or enabled:
            ds[name] = {**(ds.get(name) or {}), "enabled": bool(enabled)}
        if enabled:
            dtype = name
    if bf16 and fp16:
        raise ConfigError("--bf16 and --fp16: choose one")
    if dtype == "fp16":
        unreproducible.append("fp16: DeepSpeed's CPU accelerator has no fp16 (run the check with --bf16, or on a GPU)")

    zero = dict(ds.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, found {stage!r}")
    hidden_size_values = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                          "stage3_param_persistence_threshold": 10 * HIDDEN}
    for key in HIDDEN_SIZE_KEYS:  # as trainer_config_finalize computes them, from the check's hidden size
        if _is_auto(zero.get(key)):
            if key == "reduce_bucket_size" or stage == 3:
                zero[key] = hidden_size_values[key]
            else:
                del zero[key]  # the Trainer fills the stage3_* keys only under ZeRO-3
    offload = (zero.get("offload_optimizer") or {}).get("device")
    offload = None if offload in (None, "none") else offload
    param_offload = (zero.get("offload_param") or {}).get("device")
    for what, device in (("offload_optimizer", offload), ("offload_param", param_offload)):
        if device == "nvme":
            unreproducible.append(f"{what} to nvme: needs DeepSpeed's async I/O op and an NVMe path, "
                                  "not reproduced on CPU")
    if offload == "cpu":
        ds["zero_force_ds_cpu_optimizer"] = False
        notes.append("CPU optimizer offload runs torch SGD on the offloaded partition (zero_force_ds_cpu_optimizer: false)")
    ds["zero_optimization"] = zero
    left_out = [section for section in ("optimizer", "scheduler") if ds.pop(section, None) is not None]
    if left_out:
        notes.append(f"the {' and '.join(left_out)} section{'s are' if len(left_out) > 1 else ' is'} left out: the "
                     "check trains with torch SGD at a constant rate, as its reference does")
    ds.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=resolved_gas,
              gradient_clipping=clip, zero_allow_untested_optimizer=True, steps_per_print=10**9)
    ds.pop("train_batch_size", None)  # DeepSpeed computes it from the three numbers above
    left = sorted(_autos(ds))
    if left:
        raise ConfigError(f"{where}: zerofix check does not know how to resolve \"auto\" for {', '.join(left)}; "
                          "give numbers there")
    return UserConfig(str(path), ds, stage, resolved_gas, micro_batch, clip, dtype, offload,
                      args.get("average_tokens_across_devices"), tuple(notes), tuple(unreproducible))


def _autos(node, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _autos(value, f"{prefix}{key}.")
    elif _is_auto(node):
        yield prefix.rstrip(".")

