"""A process that has imported what every session imports, and forks a session from itself per request.

Why: a forked session (``python -u -m zerofix.check.session --fork N``) starts an interpreter and imports torch,
DeepSpeed, transformers, accelerate and TRL before it forks its ranks: 8 - 12 CPU seconds on 2 cores, for sessions
whose runs often take less. The test suite starts dozens of them (each ``runner.alone``). A server started with the
session's exact environment imports once (``session.prepare``: the collective counters first, then every module
zerofix would patch, then frozen); each session forked from it starts with that done, copy-on-write, and then does
what a fresh one does (its plan's own imports, its ranks forked, its runs).

What is the same as a fresh session, and why:
- the environment: a server serves only the environment it was started with (one server per environment), but for
  pytest's name of the running test (``PER_REQUEST``), which the session takes from its request;
- the interpreter: the same executable; a session whose plan imports no library (``patched_modules`` false) is not
  served, so that nothing is imported in it that a fresh one would not import;
- what a fresh session imports before its ranks fork is what the server imported plus the plan's imports, which the
  session still imports itself; forking after imports is what ``session.fork_ranks`` already does;
- stdout and stderr go to the session's log, stdin is empty, it leads a session of its own (``setsid``), in the
  caller's working directory; its exit code is the one a fresh session's process would have.
``tests/test_session.py`` holds the records of sessions the server forked bitwise equal to torchrun's.

Not for a GPU: CUDA does not survive a fork (``session.fork_ranks`` refuses there too).

Protocol, one JSON line each way: the caller writes ``{"argv", "log", "cwd", "own"}``; the server answers ``forked PID``
at once and ``exit PID CODE`` when that session ended. The server forks only from its main thread and starts no
thread itself.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading

SESSION = "zerofix.check.session"
# Variables a session takes from its request rather than from its server's environment: pytest names the running
# test in one (read only by transformers' and torch's testing utilities); every other variable keys the server.
PER_REQUEST = ("PYTEST_CURRENT_TEST",)


class Forked:
    """A session the server forked: what ``zerofix.check.launch`` uses of a ``subprocess.Popen``."""

    def __init__(self, pid: int, server: Server):
        self.pid = pid
        self._server = server

    def poll(self):
        return self._server.exit_code(self.pid)

    def wait(self, timeout: float | None = None):
        return self._server.exit_code(self.pid, wait=True, timeout=timeout)


class Server:
    """One server process (started by ``python`` with ``env``) and the thread that reads its answers."""

    def __init__(self, python: str, env: dict):
        self.proc = subprocess.Popen([python, "-u", "-m", __name__], env=dict(env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._pids: list[int] = []  # the sessions it forked
        self._forked: queue.Queue = queue.Queue()
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, *rest = line.split()
            if word == "forked":
                self._forked.put(int(rest[0]))
            elif word == "exit":
                with self._ended:
                    self._codes[int(rest[0])] = int(rest[1])
                    self._ended.notify_all()
        self._forked.put(None)  # the server is gone: no answer will come
        with self._ended:
            self._ended.notify_all()

    def start(self, argv: list[str], log: str, cwd: str, own: dict | None = None) -> Forked | None:
        """Fork a session (``python -m zerofix.check.session`` + ``argv``; ``own``: its values of ``PER_REQUEST``, None
        for unset); None if the server is gone."""
        with self._lock:
            if self.proc.poll() is not None:
                return None
            try:
                self.proc.stdin.write(json.dumps({"argv": argv, "log": log, "cwd": cwd, "own": own or {}}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                return None
            try:
                pid = self._forked.get(timeout=300)  # the first request waits for the server's imports
            except queue.Empty:  # stopped, so that a late answer is never taken for the next request's
                self.proc.kill()
                return None
        if pid is None:
            return None
        self._pids.append(pid)
        return Forked(pid, self)

    def busy(self) -> bool:
        """Whether a session it forked is still running (its exit code comes only through this server)."""
        with self._ended:
            return self._reader.is_alive() and any(pid not in self._codes for pid in self._pids)

    def exit_code(self, pid: int, *, wait: bool = False, timeout: float | None = None):
        with self._ended:
            if wait:
                self._ended.wait_for(lambda: pid in self._codes or not self._reader.is_alive(), timeout)
            if pid in self._codes:
                return self._codes[pid]
            if not self._reader.is_alive():  # the server died under the session: it is not running any more
                return -9
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Pool:
    """Servers by environment, started at the first session that needs one, at most ``limit`` of them: a session of
    another environment takes the place of the server used longest ago that runs nothing (the tests' own process
    changes its environment now and then: a later session would otherwise find every place taken); where each is
    busy, or the session is not served, it starts as before."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self.servers: dict[tuple, Server] = {}
        self._served = 0
        self._lock = threading.Lock()

    def start(self, cmd: list[str], env: dict, log: str) -> Forked | None:
        """The forked session ``cmd`` would start, or None where the server cannot stand in for it."""
        if not servable(cmd):
            return None
        key = (cmd[0], tuple(sorted((k, v) for k, v in env.items() if k not in PER_REQUEST)))
        with self._lock:
            server = self.servers.pop(key, None)
            if server is None:
                if len(self.servers) >= self.limit:
                    idle = next((k for k, s in self.servers.items() if not s.busy()), None)
                    if idle is None:
                        return None
                    self.servers.pop(idle).close()
                server = Server(cmd[0], env)
            self.servers[key] = server  # the last used last
        forked = server.start(cmd[4:], log, os.getcwd(), {k: env.get(k) for k in PER_REQUEST})
        with self._lock:
            self._served += forked is not None
        return forked

    def served(self) -> int:
        """How many sessions its servers forked."""
        return self._served

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


def servable(cmd: list[str]) -> bool:
    """A forked session whose plan imports the libraries (``python -u -m zerofix.check.session --plan P ... --fork N``
    with the plan's ``patched_modules`` true)."""
    if cmd[1:4] != ["-u", "-m", SESSION] or "--fork" not in cmd:
        return False
    try:
        with open(cmd[cmd.index("--plan") + 1]) as f:
            return bool(json.load(f).get("patched_modules", True))
    except (OSError, ValueError, IndexError):
        return False


def serve() -> None:
    """The server: import, then fork a session per request line on stdin until stdin closes."""
    from zerofix.check import session

    session.prepare((), patched_modules=True)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        while children:  # reap what ended, and say so
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            answers.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the caller is gone: the sessions under way go on, each a session of its own
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                answers.close()
                _session(session, request)  # never returns
            children.add(pid)
            answers.write(f"forked {pid}\n")


def _session(session, request: dict) -> None:
    """In the forked child: become the session ``python -u -m zerofix.check.session ARGV`` would have started."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        empty = os.open(os.devnull, os.O_RDONLY)
        os.dup2(empty, 0)
        os.close(empty)
        os.chdir(request["cwd"])
        for name, value in request["own"].items():  # before the fork of its ranks, which take the environment then
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        sys.argv = [session.__file__, *request["argv"]]
        session.main(list(request["argv"]))  # --fork: its process ends in fork_ranks, its ranks in finish()
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1  # as the interpreter
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve()
