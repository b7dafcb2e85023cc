"""What every scenario's rank does around its run (issue 68: out of ``scenarios/``, which the session that runs them
imports no more): ``entry`` for a scenario launched on its own, ``run_and_record`` for the TRL scenarios, ``finish`` at a
rank's end. Imported by the scenarios and by the session alike."""
from __future__ import annotations


def run_and_record(args, train) -> None:
    """The TRL scenarios' rank: ``zerofix.patch()`` first with ``--zerofix`` (before TRL is imported), then
    ``train(args)``; writes ``rank{r}.json`` (its result, or the error: a crash is a result the tests assert,
    and zerofix's status)."""
    import json
    import os
    import traceback
    from pathlib import Path

    import zerofix
    from zerofix.check.files import write_whole

    if args.zerofix:
        zerofix.patch()
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "args": vars(args)}
    try:
        record.update(train(args))
    except Exception as exc:  # noqa: BLE001 - recorded; the test decides
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-4000:]
    record["status"] = {r.id: r.state for r in zerofix.status()}
    write_whole(out / f"rank{rank}.json", json.dumps(record, indent=1))


def entry(run) -> None:
    """A scenario launched on its own (``python -m zerofix.check.scenarios.<name>``): ``run`` with the command
    line's arguments, then ``finish()``. In a session (``zerofix.check.session``) the same ``run`` is one of many."""
    import sys

    run(sys.argv[1:])
    finish()


def finish() -> None:
    """End a rank whose results are written: barrier, destroy the process group, then leave without
    interpreter teardown. Left to interpreter exit, gloo's (and DeepSpeed's) threads sometimes die with
    "terminate called without an active exception" (SIGABRT on one rank, about 1 run in 5 with
    DeepSpeed), after everything was written; barrier + destroy alone did not stop it."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _unlink_deepspeed_shm_buffer()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _unlink_deepspeed_shm_buffer() -> None:
    """This rank's DeepSpeed segment (``zerofix.check.host.shm``), which ``os._exit`` would leave behind (every run leaked
    132 MiB of RAM without this). Called after the barrier, when no rank maps its peers' segments any more."""
    import os

    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if addr and port and rank:
        from zerofix.check.host import shm

        shm.unlink(addr, port, rank)
