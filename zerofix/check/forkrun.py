"""``torchrun --standalone --nproc_per_node N`` for a script or module whose ranks may be forked: imported once, forked.

    python -m zerofix.check.forkrun N [--import MODULE,...] (-m MODULE | SCRIPT) [ARG ...]

Why: each rank of a torchrun launch starts an interpreter and imports torch, DeepSpeed and transformers' Trainer itself
(9 CPU s a rank on CI's 2 cores), and torchrun's agent starts first. The tests that launch a scenario's own ``main`` or a
benchmark on a few ranks (tests/test_trainer_sequence_parallel.py, tests/test_deepspeed_accumulation.py) spent most of
their time there. This process imports the modules ``--import`` names (what the program imports first: a DeepSpeed
script needs no Trainer, whose import alone takes 9 CPU s), after the collective counters a session installs
(``zerofix.check.session.prepare``), forks the N ranks with the variables torchrun gives them (``session.fork_ranks``,
as ``zerofix check`` starts its own), and each rank runs the program as ``python [-m] ...`` would. A rank that fails stops the others and the exit code is 1, as with torchrun's
agent. A rank whose program ends well leaves as ``zerofix.check.rank.finish`` does: its DeepSpeed segment removed.

Not for what only a fresh interpreter shows: activation by ``ZEROFIX=1`` or ``zerofix run`` (a ``.pth`` reads them at
interpreter start) is tested under torchrun itself. Not on a GPU: CUDA does not survive a fork.
"""
from __future__ import annotations

import runpy
import shutil
import sys
import tempfile
from pathlib import Path

USAGE = "usage: python -m zerofix.check.forkrun N [--import MODULE,...] (-m MODULE | SCRIPT) [ARG ...]"


def parse(argv: list[str]) -> tuple[int, tuple[str, ...], str | None, str | None, list[str]]:
    """(ranks, modules to import first, module or None, script or None, the program's arguments); SystemExit with the
    usage on bad input."""
    given = " ".join(argv) or "nothing"
    imports: tuple[str, ...] = ()
    if len(argv) >= 3 and argv[1] == "--import":
        imports = tuple(m for m in argv[2].split(",") if m)
        argv = argv[:1] + argv[3:]
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1 or argv[1] == "--import" \
            or (argv[1] == "-m" and len(argv) < 3):
        raise SystemExit(f"{USAGE}\n(got: {given})")
    if argv[1] == "-m":
        return int(argv[0]), imports, argv[2], None, argv[3:]
    return int(argv[0]), imports, None, argv[1], argv[2:]


def main(argv=None) -> None:
    nproc, imports, module, script, args = parse(list(sys.argv[1:] if argv is None else argv))
    from zerofix.check.session import fork_ranks

    folder = Path(tempfile.mkdtemp(prefix="zerofix-forkrun-"))  # where fork_ranks notes the group's address
    # returns in each rank; this process waits for them and leaves with 0, or 1 once a rank failed (the others stopped)
    rank, _ = fork_ranks(nproc, folder, imports, False)
    if rank == 0:  # a session's launcher reads that note; nothing reads it here
        shutil.rmtree(folder, ignore_errors=True)
    sys.argv = [module or script, *args]
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` puts its folder first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            raise
    from zerofix.check.rank import finish

    finish()  # barrier (if the group is still up), the group destroyed, this rank's DeepSpeed segment removed


if __name__ == "__main__":
    main()
