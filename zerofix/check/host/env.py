"""The environment every rank here runs in: quiet, offline, one thread per rank (2 cores, 2 ranks), CPU only, and
DeepSpeed's extensions in the interpreter's own environment (the launcher, ``zerofix check``'s sessions and the CPU op's
prebuild all read it here)."""
from __future__ import annotations

import os
import sys

# The GPU tier (tools/gpu_trainer_matrix.py) sets this: its ranks see the caller's GPUs. Everywhere else the ranks
# see none, whatever the machine has, so a check on a GPU machine measures the CPU path it reports.
USE_CUDA = False


def scenario_env(extra: dict | None = None) -> dict:
    """A quiet, offline environment with one thread per rank (2 cores, 2 ranks), CPU-only unless ``USE_CUDA``;
    only ``extra`` may set ZEROFIX* variables."""
    # A ZEROFIX* variable of the caller's shell must not decide what the "unpatched" run means.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))}
    env.update({
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_DISABLED": "true", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    })
    if USE_CUDA:
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    # DeepSpeed JIT-builds a CPU op; a cache shared between environments gets corrupted.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, ".torch_extensions"))
    # One ninja whoever calls (make, an activated environment, a bare shell): the interpreter's own environment's
    # first. Two ninjas see each other's build as "command line changed" and rebuild the op (87 - 121 s).
    env["PATH"] = interpreter_path(env.get("PATH", ""))
    env.update(extra or {})
    return env


def interpreter_path(path: str) -> str:
    """``path`` with the running interpreter's bin directory (a virtual environment's, with its ninja) first."""
    first = os.path.dirname(sys.executable)
    return os.pathsep.join([first] + [p for p in path.split(os.pathsep) if p and p != first])
