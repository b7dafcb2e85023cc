"""Snippets forked from an interpreter that has already run their shared prelude (``run_python(..., prelude=P)``).

Why: a snippet that trains a tiny model spends most of its run importing (torch, zerofix patched, transformers'
Trainer: 7.5 of a 10 s run on 2 cores), and some tests start the same program many times with other arguments
(tests/test_micro_means.py: six runs on one stack). A server runs the prelude once; each snippet is a fork of it that
runs the rest.

A forked snippet is ``python -c PRELUDE+CODE ARGS`` in a fresh interpreter, the prelude's part already done:
- the same interpreter and environment: a server serves one environment, working directory and prelude (one
  server per key), but for pytest's name of the running test, which the snippet takes from its request;
- the prelude ran in ``__main__`` with ``sys.argv == ["-c"]`` and stdin empty (a prelude reads neither its arguments
  nor its input: the snippet's code after it does, with ``sys.argv == ["-c", *ARGS]``);
- its stdout and stderr are what a fresh run prints: the prelude's output, then the code's; its exit code is the
  interpreter's (``SystemExit``'s code; 1 and the traceback for an uncaught exception); ``atexit``'s functions run;
- not for a snippet that starts threads in its prelude or needs CUDA (neither survives a fork).
tests/test_preimported.py holds a forked snippet's output, exit codes and ``__main__`` equal to a fresh run's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

PER_REQUEST = ("PYTEST_CURRENT_TEST",)  # as zerofix.check.host.forkserver: every other variable keys the server

# The server, run as ``python -c SERVER``: its names live in a function, so that ``__main__`` holds only what a fresh
# ``python -c`` would (the prelude's names, then the code's).
SERVER = r'''
def _serve():
    import atexit, builtins, json, os, sys, traceback, types
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    empty = os.open(os.devnull, os.O_RDONLY)
    os.dup2(empty, 0)
    prelude = json.loads(requests.readline())
    printed = []
    for fd in (1, 2):  # the prelude's output, kept for every snippet's
        path = f"{prelude['scratch']}.{fd}"
        f = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    failed = None
    try:
        exec(compile(prelude["code"], "<string>", "exec"), main.__dict__)
    except BaseException as exc:  # a fresh run would end here: each snippet says so as that run would
        failed = exc
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        with open(f"{prelude['scratch']}.{fd}", "rb") as f:
            printed.append(f.read())
    answers.write("ready\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, path, before in ((1, request["stdout"], printed[0]), (2, request["stderr"], printed[1])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.write(f, before)
                    os.dup2(f, fd)
                    os.close(f)
                os.chdir(request["cwd"])
                for name, value in request["own"].items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                sys.argv = ["-c", *request["args"]]
                if failed is not None:
                    raise failed
                exec(compile(request["code"], "<string>", "exec"), main.__dict__)
                code = 0
            except SystemExit as exc:
                code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    atexit._run_exitfuncs()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        answers.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
_serve()
del _serve
'''


class Server:
    """One server: its process, started with the snippet's interpreter, environment and working directory."""

    def __init__(self, python: str, prelude: str, env: dict, cwd: str, scratch: str):
        self.proc = subprocess.Popen([python, "-c", SERVER], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.proc.stdin.write(json.dumps({"code": prelude, "scratch": scratch}) + "\n")
        self.proc.stdin.flush()
        self.scratch = scratch
        self.ready = False

    def _answer(self, timeout: float) -> str | None:
        """The server's next line, or None where none came in ``timeout`` seconds or the server is gone."""
        got: list = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        return got[0] if got and got[0] else None

    def run(self, code: str, args, cwd: str, own: dict, timeout: float) -> subprocess.CompletedProcess | None:
        """The snippet's completed process; None where this server cannot run it (gone, or its prelude hung)."""
        if self.proc.poll() is not None:
            return None
        if not self.ready:
            if self._answer(timeout) != "ready\n":
                self.close()
                return None
            self.ready = True
        out, err = f"{self.scratch}.out", f"{self.scratch}.err"
        cmd = [sys.executable, "-c", code, *args]
        self.proc.stdin.write(json.dumps({"code": code, "args": list(args), "cwd": cwd, "own": own,
                                          "stdout": out, "stderr": err}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        if answer is None:  # hung: the server and the snippet it forked go, as subprocess.run's child would
            self.close(kill=True)
            raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(cmd, int(answer.split()[1]), _read(out), _read(err))

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session: the server and what it forked
            else:
                self.proc.stdin.close()
            self.proc.wait()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_servers: dict[tuple, Server] = {}
_lock = threading.Lock()
_scratch = ""  # a folder for the servers' output files, made at the first


def run(prelude: str, code: str, *, env: dict, cwd: str | None, args, timeout: float) -> subprocess.CompletedProcess:
    """``python -c prelude+code *args`` as a fork of the server for (interpreter, environment, cwd, prelude), started
    at its first snippet; a fresh interpreter where the server cannot run it."""
    cwd = os.path.abspath(cwd or os.getcwd())
    key = (sys.executable, prelude, cwd, tuple(sorted((k, v) for k, v in env.items() if k not in PER_REQUEST)))
    own = {k: env.get(k) for k in PER_REQUEST}
    with _lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            global _scratch
            _scratch = _scratch or tempfile.mkdtemp(prefix="zerofix-preimported-")
            scratch = os.path.join(_scratch, f"server{len(_servers)}")
            server = _servers[key] = Server(sys.executable, prelude, {k: v for k, v in env.items()
                                                                      if k not in PER_REQUEST}, cwd, scratch)
        done = server.run(code, args, cwd, own, timeout)
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-c", prelude + code, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def close() -> None:
    with _lock:
        for server in _servers.values():
            server.close()
        _servers.clear()
