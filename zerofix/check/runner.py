"""Many scenario runs, one launch: ``Request`` (one run and how to read what it wrote) and ``Batch`` (requests run in
one session per number of ranks, ``zerofix.check.session``). ``zerofix check`` and the test suite's distributed
matrices both run through a Batch, so the libraries are imported once per rank count, not once per run.

A request's folder is ``<root>/<name>-<key>``: the key is a hash of what the run does (module, arguments, files,
environment, ranks), so the same request asked twice runs once. Within a session the requests run in the order
they were added, those marked ``late`` last: the runs that show a bug, which crash or hang by design, so that a
fresh session after one of them has little left to run.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zerofix.check import launch


Request = launch.Request  # one record for a run, from the test that asks for it to the session that runs it


class Batch:
    """Requests run together; ``progress(total)``: an object with ``set_description(name)`` (a run starts),
    ``update(1)`` (a run ended) and ``close()`` (``zerofix.check.report.progress``); ``on_outcome(request)``: called
    (from the thread that watches its session) as soon as a request's outcome is known, so that its results can be
    read while other runs go on."""

    def __init__(self, root: Path, *, python: str = sys.executable, progress=None, together: bool = True,
                 on_outcome=None, fork: bool = False):
        self.root = Path(root)
        self.python = python
        self.progress = progress
        self.together = together
        self.on_outcome = on_outcome
        self.fork = fork  # the sessions' ranks forked after one import (launch.run_session), not torchrun's
        self._requests: dict[str, Request] = {}  # key -> request, in the order added
        self._outcomes: dict[str, launch.Outcome] = {}
        self._folders: dict[str, Path] = {}  # a folder a caller chose (``alone``)

    def add(self, *requests: Request) -> None:
        for request in requests:
            self._requests.setdefault(request.key, request)

    def folder(self, request: Request) -> Path:
        return self._folders.get(request.key) or self.root / f"{request.name}-{request.key}"

    def run(self) -> None:
        """Run every request added and not run yet: one session per number of ranks, the sessions side by side
        (``together``, the default: on 2 cores a 2-rank session's runs keep about 1.4 of them busy)."""
        pending = [r for k, r in self._requests.items() if k not in self._outcomes]
        if not pending:
            return
        from zerofix.check.host import shm

        shm.clear_stale()  # a segment a killed rank left behind would stall a session given its port
        bar = self.progress(len(pending)) if self.progress else None
        lock = threading.Lock()
        requests = {r.key: r for r in pending}

        first_run = threading.Event()  # the largest session's ranks have imported everything: the others may start

        def started(run):
            first_run.set()
            if bar:
                with lock:
                    bar.set_description(names[run.id])

        def ended(run, outcome):
            self._outcomes[run.id] = outcome
            with lock:
                if bar:
                    bar.update(1)
                if self.on_outcome:
                    self.on_outcome(requests[run.id])

        sizes = sorted({r.nproc for r in pending}, reverse=True)  # the most ranks first: the longest session
        # One-process runs that make no process group ride in the largest session, shared out over its ranks before
        # its group exists: one set of ranks for every run, no interpreter start and imports of their own.
        hosted = {}
        if self.together and sizes[0] > 1:
            singles = [r for r in pending if r.nproc == 1 and not r.needs_group]
            hosted = {r.key: i % sizes[0] for i, r in enumerate(singles)}
            if len(hosted) == sum(r.nproc == 1 for r in pending):
                sizes = [n for n in sizes if n != 1]

        def session(nproc: int) -> None:
            group = [r for r in pending if r.nproc == nproc and r.key not in hosted]
            if nproc == sizes[0]:
                group = [r for r in pending if r.key in hosted] + group
            group.sort(key=lambda r: (r.key not in hosted, r.late))  # stable: hosted first, the late ones last
            runs = [self._run(r, hosted.get(r.key)) for r in group]
            imports = tuple(dict.fromkeys(m for r in group for m in (*r.imports, r.module)))
            try:
                # the modules zerofix patches only where a run uses a library (not for runs that train nothing)
                launch.run_session(runs, nproc=nproc, session_dir=self.root / f"session-{nproc}", python=self.python,
                                   imports=imports, patched_modules=any(r.imports for r in group),
                                   on_start=started, on_end=ended, fork=self.fork)
            finally:
                first_run.set()

        names = {r.key: r.name for r in pending}
        try:
            if self.together and len(sizes) > 1:
                # Side by side, but the smaller sessions start once the largest one runs: their imports would
                # otherwise compete with its ranks' for the two cores, where its runs leave room.
                with ThreadPoolExecutor(len(sizes)) as pool:
                    futures = [pool.submit(session, sizes[0])]
                    first_run.wait()
                    futures += [pool.submit(session, n) for n in sizes[1:]]
                    for future in futures:
                        future.result()
            else:
                for nproc in sizes:
                    session(nproc)
        finally:
            if bar:
                bar.close()

    def _run(self, request: Request, rank: int | None = None) -> Request:
        """``request`` placed in this batch (its folder made and its files written)."""
        out = self.folder(request)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in request.files:
            (out / name).write_text(text)
        bound = None
        if request.bound:
            other, factor, minimum = request.bound
            bound = (other.key, factor, minimum)

        def placed(text: str) -> str:
            return text.replace("{out}", str(out)).replace("{root}", str(self.root))

        return dataclasses.replace(request, id=request.key, out=out, rank=rank, bound=bound,
                                   accelerate=request.accelerate and placed(request.accelerate),
                                   argv=tuple(placed(str(a)) for a in request.argv))

    def timings(self) -> dict:
        """Per session (by its number of ranks), per launch: each rank's start-up (seconds and CPU seconds from the
        launch to its libraries imported) and the seconds and CPU seconds it spent in each run (by request name)."""
        names = {key: f"{r.name}-{key}" for key, r in self._requests.items()}
        out = {}
        for session in sorted(self.root.glob("session-*")):
            out[session.name[len("session-"):]] = [
                {"launch": launch_["launch"], "ranks": [
                    {"ready": rank["ready"], "runs": {names.get(k, k): v for k, v in rank["runs"].items()}}
                    for rank in launch_["ranks"]]}
                for launch_ in launch.timings(session)]
        return out

    def outcome(self, request: Request) -> launch.Outcome:
        if request.key not in self._outcomes:
            self.add(request)
            self.run()
        return self._outcomes[request.key]

    def records(self, request: Request) -> list[dict]:
        """The ranks' records; raises the run's LaunchError where it crashed or hung."""
        return self.outcome(request).get()

    def result(self, request: Request):
        return request.interpret(self.folder(request), self.records(request))


def alone(request: Request, folder: Path, *, fork: bool = False):
    """One request in a session of its own, its files in ``folder`` (a test or a tool that needs nothing else);
    ``fork``: its ranks forked after one import, as the check's are (not on a GPU: CUDA does not survive a fork)."""
    batch = Batch(Path(folder) / ".session", fork=fork)
    batch._folders[request.key] = Path(folder)
    return batch.result(request)


def files(**named) -> tuple:
    """``files=`` of a Request: each value written as JSON (a str as it is)."""
    return tuple((name, text if isinstance(text, str) else json.dumps(text)) for name, text in named.items())
