"""Run scenarios under ``torchrun`` (gloo, CPU) in a subprocess and collect each rank's JSON: many runs in one set
of ranks (``run_session``), or one launch of a scenario on its own (``torchrun``, ``accelerate_launch``: activation
at start-up, a launcher in front of the interpreter)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from zerofix.check.host.env import interpreter_path, scenario_env  # noqa: F401 - the launcher's environment


class LaunchError(RuntimeError):
    """A launch that failed or timed out; ``tail``: the last lines of the failing rank's own output."""

    def __init__(self, message: str, tail: str = ""):
        super().__init__(message)
        self.tail = tail or "\n".join(message.splitlines()[-12:])


def torchrun(module: str, args: list[str], *, nproc: int, out_dir: Path, timeout: float = 600,
             env: dict | None = None, python: str = sys.executable, launcher_prefix=()) -> list[dict]:
    """Launch ``python -m module args`` on ``nproc`` ranks; return the ranks' ``rank{r}.json`` records
    (every file matching ``**/rank*.json`` under out_dir, sorted). ``launcher_prefix`` goes before the
    interpreter (e.g. ``zerofix run --``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher_prefix, python, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "-m", module, *args, "--out", str(out_dir)]
    return _launch(cmd, module, nproc=nproc, out_dir=out_dir, timeout=timeout, env=env)


def accelerate_launch(module: str, args: list[str], *, config: dict, nproc: int, out_dir: Path,
                      timeout: float = 600, env: dict | None = None, python: str = sys.executable) -> list[dict]:
    """Launch ``accelerate launch --config_file <config> -m module args`` on ``nproc`` ranks (the config,
    an accelerate config as a dict, is written next to the results); return the ranks' records."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file = out_dir / "accelerate_config.json"  # accelerate reads JSON as well as YAML
    config_file.write_text(json.dumps(config, indent=1))
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--num_processes", str(nproc), "-m", module, *args, "--out", str(out_dir)]
    return _launch(cmd, module, nproc=nproc, out_dir=out_dir, timeout=timeout, env=env)


@dataclass(frozen=True, eq=False)
class Request:
    """One scenario run: ``python -m <module> <argv>`` on ``nproc`` ranks, as one run of a session (issue 68: the record
    the test suite, ``zerofix check`` and the session launcher share). ``argv`` (and ``accelerate``) may name ``{out}``,
    the run's folder, into which ``files`` ((name, text) pairs) are written first, and ``{root}``, the batch's (what runs
    share: a model the first run that needs it makes). ``env``: variables for this run only; ``accelerate``: an accelerate
    config (JSON) whose ``accelerate launch`` variables the run gets too (``accelerate_env``, computed in the ranks);
    ``timeout``: seconds from the run's start; ``bound``: ``(request, factor, minimum)``, a limit of ``factor`` times that
    request's run time (at least ``minimum`` seconds), for a run that may hang by design (its unpatched half);
    ``late``: run after the others of its session (a run that shows a bug, which crashes or hangs by design);
    ``imports``: the libraries the run uses (its session imports them, and every module zerofix patches, before its first
    run); ``needs_group``: False for a one-process run that makes no process group (a Trainer or accelerate loop without
    DeepSpeed), which a larger session's ranks can run before their own group exists; ``interpret(folder, records)``:
    what ``runner.Batch.result`` returns.

    Placed in a batch (``runner.Batch``), the same record also says where it runs: ``id`` (its key), ``out`` (its
    folder; ``{out}`` and ``{root}`` replaced), ``rank`` (a run of one process that a rank of a larger session runs before
    that session's process group exists) and ``bound`` naming the other run by its id."""

    name: str
    module: str
    argv: tuple = ()
    nproc: int = 1
    files: tuple = ()
    env: tuple = ()
    accelerate: str | None = None
    timeout: float = 600
    bound: tuple | None = None
    late: bool = False
    needs_group: bool = True
    imports: tuple = ()
    interpret: object = field(default=None, repr=False)
    id: str | None = None
    out: Path | None = field(default=None, compare=False)
    rank: int | None = None

    @property
    def key(self) -> str:
        """A hash of what the run does (module, arguments, files, environment, ranks): the same request asked twice runs
        once."""
        import hashlib

        what = json.dumps([self.module, list(self.argv), self.nproc, list(self.files), list(self.env), self.accelerate])
        return hashlib.sha1(what.encode()).hexdigest()[:10]


@dataclass
class Outcome:
    """A run's result: the ranks' records, or the error of a run that crashed, hung or never started."""

    records: list | None = None
    error: LaunchError | None = None
    seconds: float | None = None

    def get(self) -> list[dict]:
        if self.error is not None:
            raise self.error
        return self.records


SESSION = "zerofix.check.session"
_START = "[zerofix session] start "


# A forked session's interpreter start, stood in for by a process that imported the libraries already
# (``zerofix.check.host.forkserver.Pool``, which the test suite sets: dozens of sessions, 8 - 12 CPU s of imports
# each); None: every session starts its own interpreter, as ``zerofix check`` does.
fork_server = None


def run_session(runs: list[Request], *, nproc: int, session_dir: Path, env: dict | None = None,
                python: str = sys.executable,
                imports=(), patched_modules: bool = True, poll: float = 0.1, on_start=None,
                on_end=None, fork: bool = False) -> dict[str, Outcome]:
    """Run ``runs`` in order on one set of ``nproc`` ranks (``zerofix.check.session``); {run id: Outcome}.

    A run that hangs past its limit (every rank is killed) or crashes fails alone, with its own cause (the failing
    rank's traceback from the session's output since that run started); a fresh session runs the runs after it.
    ``imports``: modules the session imports before its first run (then frozen out of the garbage collector's
    way), with every module zerofix would patch unless ``patched_modules`` is False. ``on_start(run)`` and
    ``on_end(run, outcome)`` are called as runs start and end (whatever their outcome). ``fork``: the ranks are
    forked from one process after its imports (``zerofix.check.session.fork_ranks``: one import instead of one per
    rank, and no launcher agent to start first) instead of launched by torchrun."""
    session_dir = Path(session_dir)
    session_dir.mkdir(parents=True, exist_ok=True)
    if len({r.id for r in runs}) != len(runs):
        raise ValueError("two runs of one session share an id")
    outcomes: dict[str, Outcome] = {}

    def ended(run, outcome):
        outcomes[run.id] = outcome
        if on_end:
            on_end(run, outcome)

    pending, attempt = list(runs), 0
    while pending:
        folder = session_dir / f"launch{attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        attempt += 1
        for run in pending:
            Path(run.out).mkdir(parents=True, exist_ok=True)
        plan = {"imports": list(imports), "patched_modules": patched_modules, "runs": [
            {"id": r.id, "module": r.module, "argv": [*r.argv, "--out", str(r.out)], "env": dict(r.env),
             "accelerate": json.loads(r.accelerate) if r.accelerate else None, "rank": r.rank} for r in pending]}
        (folder / "plan.json").write_text(json.dumps(plan, indent=1))
        session = ["-m", SESSION, "--plan", str(folder / "plan.json"), "--dir", str(folder)]
        cmd = ([python, "-u", *session, "--fork", str(nproc)] if fork else
               [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *session])
        try:
            finished, failed, error = _watch(cmd, pending, outcomes, ended, nproc=nproc, folder=folder, env=env,
                                             poll=poll, on_start=on_start)
        finally:
            _remove_segments(folder)
        if error is None and len(finished) == len(pending):
            break
        left = [i for i in range(len(pending)) if i not in finished]
        if error is None:  # ended well without running everything: never expected
            failed, error = left[0], LaunchError(f"the session ended after {len(finished)} of {len(pending)} runs")
        if not any(_started(folder, i) for i in left):
            # nothing ran (the session itself failed): the same cause for every run left, no endless relaunch
            for i in left:
                ended(pending[i], Outcome(error=error))
            break
        ended(pending[failed], Outcome(error=error))
        pending = [pending[i] for i in left if i != failed]  # a fresh session for the others (unfinished ones again)
    return outcomes


def _watch(cmd, pending, outcomes, ended, *, nproc, folder, env, poll, on_start):
    """Run one session until it ends or a run passes its limit; ``ended(run, outcome)`` for each run all of its ranks
    finished. Returns (indices finished, the index of the run that failed or None, its error or None)."""
    log = folder / "session.log"
    ranks_of = [{r.rank} if r.rank is not None else set(range(nproc)) for r in pending]
    finished, announced = set(), set()
    with open(log, "w") as out:
        full_env = scenario_env({"LOCAL_SIZE": str(nproc), **(env or {})})
        try:
            proc = fork_server.start(cmd, full_env, str(log)) if fork_server is not None else None
            if proc is None:
                proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        except OSError as exc:
            return finished, None, LaunchError(f"could not start {cmd[0]}: {exc}")
        try:
            while True:
                code = proc.poll()
                starts, dones = _progress(folder, nproc)
                for index, run in enumerate(pending):
                    if index in starts and index not in announced:
                        announced.add(index)
                        if on_start:
                            on_start(run)
                    if index not in finished and ranks_of[index] <= set(dones.get(index, ())):
                        finished.add(index)
                        seconds = max(dones[index].values()) - min(starts[index].values())
                        ended(run, Outcome(records=_records(run.out), seconds=seconds))
                for index, run in enumerate(pending):
                    # a run's clock starts once all of its ranks are in it (a rank still in its share of the
                    # one-process runs has not started the session's first collective run yet)
                    if index in finished or not ranks_of[index] <= set(starts.get(index, ())):
                        continue
                    limit = _limit(run, outcomes)
                    if time.time() - max(starts[index].values()) > limit:
                        kill_tree(proc.pid)
                        proc.wait()
                        text = _since_start(log, run.id)
                        return finished, index, LaunchError(
                            f"{run.module} timed out after {limit:.0f}s on {nproc} rank(s)\n{text[-6000:]}",
                            tail=f"timed out after {limit:.0f} s; last lines:\n" + failing_rank_tail(text)
                            + f"\nfull log: {log}")
                if code is not None:
                    break
                time.sleep(poll)
        except KeyboardInterrupt:  # Ctrl-C of zerofix check: its own session would keep the ranks running
            kill_tree(proc.pid)
            raise
    if code == 0:
        return finished, None, None
    left = [i for i in range(len(pending)) if i not in finished]
    failed = _failed_index(folder, left)
    if failed is None:
        return finished, left[0] if left else None, LaunchError(
            f"{SESSION} failed on {nproc} rank(s) (exit {code}); last lines of the ranks' output:\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    text = _since_start(log, pending[failed].id)
    first = first_error(folder)
    tail = (f"rank {first[0]}:\n" + (real_cause(first[1]) or "\n".join(first[1].splitlines()[-12:])) if first
            else failing_rank_tail(text))
    return finished, failed, LaunchError(
        f"{pending[failed].module} failed on {nproc} rank(s) (exit {code}); last lines of the ranks' output:\n"
        + "\n".join(text.splitlines()[-60:]), tail=tail + f"\nfull log: {log}")


def _errors(folder: Path) -> list[tuple[float, int, dict]]:
    """The ranks' error files (the session writes one for an exception no run recorded): (when, rank, content),
    oldest first."""
    found = []
    for path in folder.glob("error.rank*"):
        try:
            found.append((path.stat().st_mtime, int(path.name[len("error.rank"):]), json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda e: (e[0], e[1]))


# torch's C++ extension builder: the one rank that builds raises this; its peers, waiting on the build's lock, then
# load a library that was never written (ImportError) and may write their error first on a loaded machine
_FAILED_BUILD = "Error building extension"


def first_error(folder: Path) -> tuple[int, str] | None:
    """(rank, traceback) of the first exception: the cause; a peer's later one is usually its consequence (the
    collective it waited in broke). A failed extension build comes first whenever it was written: it is the cause
    of its peers' errors, never their consequence."""
    errors = sorted(_errors(folder), key=lambda e: _FAILED_BUILD not in e[2].get("traceback", ""))  # stable: by time
    return (errors[0][1], errors[0][2].get("traceback", "")) if errors else None


def _remove_segments(folder: Path) -> None:
    """The DeepSpeed segments of a session that ended (a killed or crashed rank leaves its own: ``shm``)."""
    from zerofix.check.host import shm

    try:
        master = json.loads((folder / "master.json").read_text())
    except (OSError, ValueError):
        return
    if master.get("MASTER_ADDR") and master.get("MASTER_PORT"):
        shm.unlink(master["MASTER_ADDR"], master["MASTER_PORT"])


def _failed_index(folder: Path, left: list[int]) -> int | None:
    """The run a failed session failed in: the one the first error file names, else the first unfinished run that
    started; None when no run had started."""
    errors = _errors(folder)
    if errors and "index" in errors[0][2]:
        return errors[0][2]["index"]
    return next((i for i in left if _started(folder, i)), None)


def _progress(folder: Path, nproc: int) -> tuple[dict, dict]:
    """({run index: {rank: start time}}, {run index: {rank: done time}}) from the ranks' progress files."""
    starts, dones = {}, {}
    for rank in range(nproc):
        path = folder / f"progress.rank{rank}"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) != 4 or fields[0] == "ready":  # a line being written, or the ranks' start-up
                continue
            event, index, when = fields[0], int(fields[1]), float(fields[2])
            (starts if event == "start" else dones).setdefault(index, {})[rank] = when
    return starts, dones


def timings(session_dir: Path) -> list[dict]:
    """Where a session's time went, per launch of it (a fresh one follows a run that hung or crashed): per rank, the
    seconds and CPU seconds from the launch to the ranks' libraries imported (``ready``: the launcher's start and
    the imports), and per run id the seconds and CPU seconds each rank spent in it."""
    out = []
    for folder in sorted(Path(session_dir).glob("launch*"), key=lambda p: int(p.name[len("launch"):])):
        plan = json.loads((folder / "plan.json").read_text())
        began = (folder / "plan.json").stat().st_mtime
        ranks = []
        for path in sorted(folder.glob("progress.rank*")):
            rows = [line.split() for line in path.read_text().splitlines() if len(line.split()) == 4]
            ready = next(([round(float(r[2]) - began, 2), round(float(r[3]), 2)] for r in rows if r[0] == "ready"), None)
            runs, opened = {}, {}
            for event, index, wall, cpu in rows:
                if event == "start":
                    opened[index] = (float(wall), float(cpu))
                elif event == "done" and index in opened:
                    runs[plan["runs"][int(index)]["id"]] = [round(float(wall) - opened[index][0], 2),
                                                            round(float(cpu) - opened[index][1], 2)]
            ranks.append({"ready": ready, "runs": runs})
        out.append({"launch": folder.name, "ranks": ranks})
    return out


def _started(folder: Path, index: int) -> bool:
    return any(f"start {index} " in p.read_text() for p in folder.glob("progress.rank*"))


def _limit(run: Request, outcomes: dict) -> float:
    if run.bound:
        other, factor, minimum = run.bound
        seconds = outcomes.get(other) and outcomes[other].seconds
        if seconds:
            return max(minimum, factor * seconds)
    return run.timeout


def _since_start(log: Path, run_id: str) -> str:
    """The session's output from the run's start marker on (the launcher's own footer included)."""
    text = log.read_text(errors="replace")
    at = text.find(_START + run_id + "\n")
    return text[at:] if at >= 0 else text


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("**/rank*.json"))]


_ACCELERATE_ENV: dict = {}


def accelerate_env(config: dict, *, nproc: int) -> dict:
    """The variables ``accelerate launch --config_file <config>`` sets for its ranks (DeepSpeed: which config, ZeRO-3
    init, mixed precision), computed by accelerate's own launcher code, so that a run of a session trains as it would
    under that launch. The launcher's own (PYTHONPATH, the port) are left out: a session's ranks exist already."""
    key = json.dumps([config, nproc], sort_keys=True)
    if key not in _ACCELERATE_ENV:
        import tempfile

        import accelerate.commands.launch as accelerate_launcher

        if config.get("distributed_type") != "DEEPSPEED":
            raise ValueError("accelerate_env knows accelerate launch's DeepSpeed launcher only")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
            json.dump(config, file)
        captured = {}
        # accelerate's own launch_command, up to the point where its DeepSpeed launcher would start torchrun
        original = accelerate_launcher.deepspeed_launcher
        accelerate_launcher.deepspeed_launcher = lambda args: captured.update(
            accelerate_launcher.prepare_deepspeed_cmd_env(args)[1])
        try:
            args = accelerate_launcher.launch_command_parser().parse_args(
                ["--config_file", file.name, "--num_processes", str(nproc), "--main_process_port", "0", "-m", "zerofix"])
            accelerate_launcher.launch_command(args)
        finally:
            accelerate_launcher.deepspeed_launcher = original
            os.unlink(file.name)
        env = captured
        _ACCELERATE_ENV[key] = {k: v for k, v in env.items()
                                if os.environ.get(k) != v and k not in ("PYTHONPATH", "MASTER_PORT", "MASTER_ADDR")}
    return dict(_ACCELERATE_ENV[key])


def _launch(cmd, module, *, nproc, out_dir, timeout, env):
    # DeepSpeed < 0.16 on CPU counts "devices" with `numactl --hardware` unless LOCAL_SIZE says how many
    # local ranks there are (its own launcher sets it); numactl is not installed everywhere.
    env = {"LOCAL_SIZE": str(nproc), **(env or {})}
    # Its own session, so that a timeout kills the ranks too, not just the launcher (orphaned ranks of a
    # hung run otherwise keep the cores and their DeepSpeed /dev/shm segments).
    proc = subprocess.Popen(cmd, env=scenario_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except KeyboardInterrupt:  # Ctrl-C of zerofix check: its own session would keep the ranks running
        kill_tree(proc.pid)
        raise
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, _ = proc.communicate()
        log = out_dir / "launcher.log"
        log.write_text(stdout)
        raise LaunchError(f"{module} timed out after {timeout:.0f}s on {nproc} rank(s)\n{stdout[-6000:]}",
                          tail=f"timed out after {timeout:.0f} s; last lines:\n"
                          + failing_rank_tail(stdout) + f"\nfull log: {log}") from None
    log = out_dir / "launcher.log"
    log.write_text(stdout)
    if proc.returncode != 0:
        raise LaunchError(f"{module} failed on {nproc} rank(s) (exit {proc.returncode}); last lines "
                          f"of the ranks' output:\n" + "\n".join(stdout.splitlines()[-60:]),
                          tail=failing_rank_tail(stdout) + f"\nfull log: {log}")
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("**/rank*.json"))]


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process below it. Its process group is not enough: torch's elastic agent
    starts each rank in a session of its own (measured with torch 2.13: the ranks of a hung run outlived
    ``killpg`` and kept the launcher's output pipe open, so the timeout itself hung)."""
    victims = [pid] + _descendants(pid)
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def failing_rank_tail(output: str, lines: int = 12) -> str:
    """The last lines of the first failing rank's traceback, headed by the rank: torchrun's "Root Cause"
    names the rank, and torch prefixes the traceback of a rank with a process group by "[rank<r>]:". Without
    them (a rank that died before its process group existed, e.g. when DeepSpeed could not build its CPU
    op), torchrun's footer says nothing: the real exception is found in the output (``real_cause``)."""
    cause = output.split("Root Cause", 1)[1] if "Root Cause" in output else ""
    found = re.search(r"\brank\s*:\s*(\d+)", cause)
    if found:
        prefix = f"[rank{found.group(1)}]:"
        own = [line[len(prefix):].removeprefix(" ") for line in output.splitlines() if line.startswith(prefix)]
        own = [line for line in own if line.strip(" ^~")]  # not the blank and the caret lines
        if own:
            return f"rank {found.group(1)}:\n" + "\n".join(own[-lines:])
    return real_cause(output) or "\n".join(output.splitlines()[-lines:])


# The last line of a Python traceback: "pkg.module.SomeError: message" (optionally torch's "[rank1]:" prefix).
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit))\b(:.*)?$")
# torchrun's own exceptions, which only say that a rank failed
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "SignalException")
# A compiler's own words in a failed C++ extension build (a missing compiler, a missing header)
_BUILD_LINE = re.compile(r"(: not found$|: error: |fatal error|command not found|No such file or directory$)")


def real_cause(output: str, limit: int = 300) -> str | None:
    """The first exception a rank raised, from the raw output (the rank that failed first is the cause; the
    others usually fail because of it), with the build tool's own line when a C++ extension did not build. A failed
    extension build is the cause wherever it was printed (as in ``first_error``): a peer waiting on torch's build lock
    loads the library that was never written and may print its ImportError first. None when the output holds no
    traceback."""
    causes = list(_exceptions(output, limit))
    return next((text for text in causes if _FAILED_BUILD in text), causes[0] if causes else None)


def _exceptions(output: str, limit: int):
    """Each traceback's own exception line in the output, in order, with its build tool's line where there is one."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        match = _EXCEPTION_LINE.match(line.strip())
        if not match or match.group(1).rsplit(".", 1)[-1] in _LAUNCHER_EXCEPTIONS:
            continue
        if not any(l.lstrip().startswith(("Traceback", "[rank")) or l.startswith("  File ") for l in lines[max(0, i - 40):i]):
            continue  # not the end of a traceback (a log line that merely mentions an error)
        if any(l.strip().startswith(("The above exception", "During handling")) for l in lines[i + 1:i + 4]):
            continue  # a chained cause: the exception raised from it says more (and comes next)
        text = match.group(0) if not line.startswith("[rank") else line.split(":", 1)[1].strip()
        text = text if len(text) <= limit else text[:limit - 3] + "..."
        build = next((l.strip() for l in lines[i:i + 60] if _BUILD_LINE.search(l.strip())), None)
        yield text + (f"\n{build}" if build else "")
