"""A scenario that trains nothing, for the tests of ``zerofix.check.session`` and its launcher: it writes its rank's
record (the process's pid, the world it saw, an all-reduce of the ranks' numbers), and on request fails the way a
real run can fail: ``--hang`` (sleeps in the all-reduce's place on the named rank: the other rank waits in the
collective, as a hang does), ``--raise`` (an exception no run records), ``--exit`` (the process ends: a segfault or a
killed rank)."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from zerofix.check.files import write_whole


def run(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hang", type=int, default=None, help="the rank that never reaches the collective")
    p.add_argument("--raise", dest="raise_", type=int, default=None, help="the rank that raises")
    p.add_argument("--exit", type=int, default=None, help="the rank whose process ends (exit code 3)")
    p.add_argument("--tag", default="", help="anything: two runs that differ only in it are two runs")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if args.raise_ == rank:
        raise RuntimeError(f"probe: rank {rank} raised on purpose")
    if args.exit == rank:
        os._exit(3)
    if args.hang == rank:
        time.sleep(3600)
    total = torch.tensor([float(rank + 1)])
    if world > 1:
        dist.all_reduce(total)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / f"rank{rank}.json", json.dumps({"rank": rank, "world": world, "pid": os.getpid(),
                                                      "sum": float(total), "random": torch.rand(1).item(),
                                                      "tag": args.tag, "launch_env": launch_env()}))


def launch_env() -> dict:
    """The variables a launcher sets for its ranks (torchrun's, ``zerofix.check.session.torchrun_env``'s)."""
    return {k: v for k, v in os.environ.items() if k in LAUNCH_VARIABLES or k.startswith("TORCHELASTIC_")}


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING")


if __name__ == "__main__":
    from zerofix.check.rank import entry

    entry(run)
