"""One set of ranks that runs many scenario runs in turn (``python -m zerofix.check.session --plan FILE``).

A launch costs an interpreter start per rank and the import of torch, DeepSpeed, transformers and accelerate
(5 s per rank on a quiet 2-core machine, 15 s on a busy one) to train a model that needs milliseconds. A
session pays that once: its ranks make the process group once and run every run of the plan, each as
``module.run(argv)`` would run in a launch of its own (the scenario modules' ``main`` is ``run`` + ``finish``).

Its ranks come from torchrun (the test suite's matrices) or, with ``--fork N`` (``zerofix check``), from this
process itself: it imports once and forks the N ranks, with the variables torchrun gives them (``fork_ranks``).

Between runs, ``reset()`` puts back what a run leaves behind in the process: zerofix's fixes and what they saw,
accelerate's shared state, transformers' DeepSpeed config, the environment (the Trainer and accelerate write
``ACCELERATE_*`` variables into it), torch's grad mode, default dtype, thread count and random generators. Every
run starts from the same random state, so a run's records do not depend on which runs came before it
(``tests/test_session.py`` holds that bitwise).

A run of one process that makes no process group (a Trainer without DeepSpeed) does not need a session of its own:
the plan gives it a rank (``"rank"``), and that rank runs it first, before the session's process group exists, with
the environment ``torchrun --nproc_per_node 1`` gives its rank (``one_process``); the ranks share such runs out.

Progress goes to ``<dir>/progress.rank<r>`` as lines ``ready``, ``start <index>`` and ``done <index>``, each with the
wall-clock time and the process's CPU time (flushed; ``zerofix.check.launch.timings`` reads them), and a
line ``[zerofix session] start <id>`` on stdout, so that the launcher (``zerofix.check.launch.run_session``)
knows which run a hang or a crash belongs to and can start a fresh session for the runs after it. An exception a
run does not record itself ends the session, its run's index and traceback in ``<dir>/error.rank<r>``: the ranks
of a run that failed on one rank cannot be trusted with the next run's collectives.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

# What an interpreter the session launcher started had: put back after every run.
_ENVIRON = dict(os.environ)
_SEED = 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True,
                   help="JSON file: {\"runs\": [{id, module, argv, env, accelerate, rank}], \"imports\": [...]}")
    p.add_argument("--dir", required=True, help="the session's folder (progress and error files)")
    p.add_argument("--fork", type=int, metavar="N", help="start the N ranks by forking this process once it has "
                   "imported the libraries (the variables torchrun gives its ranks set here), instead of being one "
                   "rank of a torchrun launch")
    args = p.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    imports, patched_modules = plan.get("imports", ()), plan.get("patched_modules", True)
    # cpu_offset: a forked rank's own CPU clock starts at the fork, after the imports made for it
    if args.fork:
        rank, cpu_offset = fork_ranks(args.fork, Path(args.dir), imports, patched_modules)  # returns in each rank
    else:
        rank, cpu_offset = int(os.environ.get("RANK", "0")), 0.0
        if rank == 0:
            _write_master(Path(args.dir))
        prepare(imports, patched_modules=patched_modules)
    progress = open(Path(args.dir) / f"progress.rank{rank}", "a", buffering=1)  # noqa: SIM115 - open to the end
    progress.write(f"ready - {time.time():.3f} {cpu_offset + time.process_time():.3f}\n")
    for index, run in enumerate(plan["runs"]):
        alone = run.get("rank") is not None  # one process: this rank's share, before the group exists
        if alone and run["rank"] != rank:
            continue
        print(f"[zerofix session] start {run['id']}", flush=True)
        progress.write(f"start {index} {time.time():.3f} {cpu_offset + time.process_time():.3f}\n")
        try:
            with one_process() if alone else _nothing():
                os.environ.update(run.get("env", {}))
                if run.get("accelerate"):  # what `accelerate launch` with this config would have set
                    from zerofix.check import launch

                    world = int(os.environ.get("WORLD_SIZE", "1"))
                    os.environ.update(launch.accelerate_env(run["accelerate"], nproc=world))
                seed_everything()
                importlib.import_module(run["module"]).run(list(run["argv"]))
                reset()
        except BaseException:
            # Which run failed, for the launcher (several one-process runs may be under way on different ranks);
            # then the session ends: the ranks of a failed run cannot be trusted with the next run's collectives.
            from zerofix.check.files import write_whole

            write_whole(Path(args.dir) / f"error.rank{rank}", json.dumps(
                {"index": index, "traceback": traceback.format_exc()[-8000:]}))
            raise
        if not alone:
            barrier()
        progress.write(f"done {index} {time.time():.3f} {cpu_offset + time.process_time():.3f}\n")
    progress.close()
    from zerofix.check.rank import finish

    finish()


def _write_master(folder: Path) -> None:
    """The process group's address, for the launcher to remove its DeepSpeed segments however the session ends."""
    (folder / "master.json").write_text(json.dumps({k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}))


def torchrun_env(nproc: int) -> dict:
    """What ``torchrun --standalone --nproc_per_node <nproc>`` (torch 2.x) sets for every one of its ranks, less
    what only its agent reads (its error files, the signals it forwards); each rank adds RANK, LOCAL_RANK and
    ROLE_RANK. Without the agent, rank 0 hosts the store (TORCHELASTIC_USE_AGENT_STORE False), as under
    ``torch.distributed.launch``."""
    import uuid

    return {"MASTER_ADDR": "localhost", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": str(uuid.uuid4()), "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            **({} if "OMP_NUM_THREADS" in os.environ or nproc == 1 else {"OMP_NUM_THREADS": "1"})}


def fork_ranks(nproc: int, folder: Path, imports, patched_modules: bool) -> tuple[int, float]:
    """Import once, then fork the session's ``nproc`` ranks: returns ``(rank, CPU seconds the imports took)`` in
    each rank; this process itself waits for them and exits as torchrun's agent does (0, or 1 once a rank failed,
    the others then stopped).

    Why: every rank of a torchrun launch imports torch, DeepSpeed, transformers, accelerate and TRL itself (about
    8 CPU seconds each on 2 cores), after the agent's own start (3 - 7 s before the first rank starts). A rank
    forked after the imports starts with them done, from the same frozen objects (``freeze_once``), copy-on-write.
    Forking is safe there: nothing has started a thread pool or CUDA yet (checked), as with a DataLoader's forked
    workers."""
    import signal

    global _ENVIRON
    os.environ.update(torchrun_env(nproc))
    _write_master(folder)
    prepare(imports, patched_modules=patched_modules)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the session's imports initialised CUDA: its ranks cannot be forked (run it under torchrun)")
    imported_cpu = time.process_time()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            _ENVIRON = dict(os.environ)  # what reset() puts back: a torchrun rank's environment
            return rank, imported_cpu
        children[pid] = rank
    code = 0
    while children:
        pid, status = os.wait()
        children.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and code == 0:
            code = 1  # as torchrun: the other ranks are stopped (they may be waiting in a collective for this one)
            for other in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
            deadline = time.time() + 5
            while children and time.time() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    children.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not the ranks' exit handlers again: they ran in each rank


# What `torchrun --nproc_per_node 1` sets for its rank (the launcher's own bookkeeping variables aside).
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1", "LOCAL_SIZE": "1"}


@contextlib.contextmanager
def one_process():
    """A run of one process on a rank of a larger session, before that session's process group exists: the
    environment a one-rank launch gives its rank, with a store of its own (a free port, not the launcher's: nothing
    of it can reach the session's own group). accelerate makes a gloo group of one there (as under a one-rank
    launch); it is destroyed after the run. DeepSpeed's communication state is not undone: a run that starts it
    needs a session of its own (``runner.Request(needs_group=True)``), and fails here if it was not given one."""
    import torch.distributed as dist

    os.environ.update(ONE_PROCESS, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                      TORCHELASTIC_USE_AGENT_STORE="False")
    yield
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None:
        raise RuntimeError("a run of one process started DeepSpeed's communication: it needs a session of its own "
                           "(runner.Request(needs_group=True))")
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a run of one process made a group of {dist.get_world_size()}")
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


@contextlib.contextmanager
def _nothing():
    yield


def prepare(imports, *, patched_modules: bool = True) -> None:
    """Once per session: count collectives before DeepSpeed can keep references to torch's functions (the probes
    of ds_accumulation read the count), import the libraries the runs use and every module zerofix would patch
    (so that every run of every session sees the same fixes applied, whichever runs came before it; a session of
    runs that use no ML library, ``patched_modules`` False, skips them), then freeze what exists so that DeepSpeed
    0.18.x's gc.collect() calls scan only the runs' own objects."""
    from zerofix.check.host import collectives

    collectives.install()
    for name in imports:
        importlib.import_module(name)
    for name in _patched_modules() if patched_modules else ():
        try:
            importlib.import_module(name)
        except ImportError:  # a target absent from this release: its fix says so in its status
            pass
    freeze_once()


def _patched_modules() -> list[str]:
    """The modules of the catalogue's targets, for every fix whose library is installed in a version in its range."""
    from zerofix import catalogue
    from zerofix.versions import installed_version, version_in_range

    out = []
    for fix in catalogue.FIXES:
        version = installed_version(fix.dist)
        if version and version_in_range(version, fix.affected):
            out += [t.module for t in fix.targets if t.module not in out]
    return out


_frozen = False


def freeze_once() -> None:
    """``gc.freeze()`` once per process, after the libraries are imported (a scenario calls it too: in a session
    the session's call is the one that counts). Later freezes follow a full collection (``collect_and_freeze``), so
    that no garbage is frozen with what survives."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()


def collect_and_freeze() -> None:
    """After a run (or one cell of a run's matrix): collect its garbage, then freeze what survives. What survives is
    mostly what the run imported lazily (DeepSpeed's first engine brings in torch.compile's dynamo and inductor and
    sympy: about 120,000 objects), which every later full collection would scan again: 45 ms each, and DeepSpeed
    0.18.x (three per ZeRO-1/2 engine), accelerate (per trainer) and the matrices (per cell) collect often. What
    survives a full collection is reachable, so freezing it changes no result; a frozen object that later becomes
    cyclic garbage is kept instead of collected (a few KiB per run, for the session's lifetime)."""
    gc.collect()
    gc.freeze()


def seed_everything() -> None:
    """The same random state at the start of every run, whatever ran before it."""
    import random

    import torch

    random.seed(_SEED)
    torch.manual_seed(_SEED)
    try:
        import numpy

        numpy.random.seed(_SEED)
    except ImportError:
        pass


def reset() -> None:
    """Put back what a run leaves in the process (see the module docstring)."""
    import torch

    import zerofix

    zerofix.unpatch()  # every fix, opt-in ones included, and what each saw (runtime details)
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(_ENVIRON)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    collect_and_freeze()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: the scenarios import zerofix.check.session, and its
    # state (the gc freeze done once) must be the one this session set.
    from zerofix.check.session import main as session_main

    session_main()
