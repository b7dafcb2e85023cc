"""Build DeepSpeed's CPU communication op ahead of the first run: ``python -m zerofix.check.host.prebuild``.

DeepSpeed JIT-builds it on CPU the first time a process group starts in a fresh extensions directory (about 30 s
of both cores, once per environment), and every rank of that first run waits for it. Built here, into the directory
the scenarios' ranks use (``host.env.scenario_env``), with the same builder DeepSpeed's communication backend calls,
the first run finds it built. CI builds the next stack's op while the previous stack's tests run (``make warm``).
Nothing else changes: the op, its flags and its directory are DeepSpeed's own; a release without the op, or without
DeepSpeed, is left alone (the runs then build nothing either).
"""
from __future__ import annotations

import os
import sys

from zerofix.check.host.env import scenario_env


def main() -> int:
    env = scenario_env()
    where = env["TORCH_EXTENSIONS_DIR"]
    # the ranks' PATH too: the same ninja builds here as in the runs, or they would build again
    os.environ.update(TORCH_EXTENSIONS_DIR=where, DS_ACCELERATOR="cpu", PATH=env["PATH"])
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("prebuild: DeepSpeed is not installed: nothing to build")
        return 0
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("prebuild: this DeepSpeed release has no CPU communication op: nothing to build")
        return 0
    builder.load()
    print(f"prebuild: DeepSpeed's CPU communication op is built in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
