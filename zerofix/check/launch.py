"""Run a scenario under ``torchrun`` (gloo, CPU) in a subprocess and collect each rank's JSON."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path


class LaunchError(RuntimeError):
    """A launch that failed or timed out; ``tail``: the last lines of the failing rank's own output."""

    def __init__(self, message: str, tail: str = ""):
        super().__init__(message)
        self.tail = tail or "\n".join(message.splitlines()[-12:])


def scenario_env(extra: dict | None = None) -> dict:
    """A quiet, offline, CPU-only environment with one thread per rank (2 cores, 2 ranks); only
    ``extra`` may set ZEROFIX* variables."""
    # A ZEROFIX* variable of the caller's shell must not decide what the "unpatched" run means.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROFIX")}
    env.update({
        "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_DISABLED": "true", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    })
    # DeepSpeed JIT-builds a CPU op; a cache shared between environments gets corrupted.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, ".torch_extensions"))
    env.update(extra or {})
    return env


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
    others usually fail because of it), with the build tool's own line when a C++ extension did not build.
    None when the output holds no traceback."""
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
        return text + (f"\n{build}" if build else "")
    return None
