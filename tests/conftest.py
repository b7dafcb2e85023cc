"""Shared test set-up: stack selection, the batch of distributed runs, and subprocess helpers.

Stack-specific regression tests carry ``@pytest.mark.stack("NAME")`` and run only on that stack. The
stack is detected by matching the installed key libraries against ``constraints/*.txt`` (``--stack``
overrides; a stack whose versions are not installed is an error, so a regression test never silently
runs on the wrong libraries).

Distributed tests declare what they launch with ``@uses(builder)`` (the ``ranks`` mark): ``builder`` takes any of the
test's parameters and ``stack`` by name and returns ``zerofix.check.runner.Request``s. After selection, the
requests of every test that will run go into one batch (``zerofix.check.runner.Batch``: one session of ranks
per rank count, the libraries imported once and the ranks forked from there), which the ``ranks`` fixture runs the first time a test asks for
it; each test then reads its own results (``ranks.result(request)``; building the same request again finds it).
A run that hangs or crashes fails only the tests that read it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from zerofix.check.host.env import interpreter_path  # os and sys only

ROOT = Path(__file__).resolve().parents[1]
# Every process a test starts (a fresh interpreter, a launcher, a framework's command line) builds and loads DeepSpeed's
# CPU op in the stack's own folder with the stack's ninja, as the ranks do (zerofix.check.host.env): under torch's shared
# default folder each stack rebuilt it in turn, 80 s of both cores in a test's setup on CI (2025-10's bf16 loss-scale
# unit test).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, ".torch_extensions"))
os.environ["PATH"] = interpreter_path(os.environ.get("PATH", ""))
# One OpenMP thread in the test process and every process it starts, as in the ranks (zerofix.check.host.env): set
# before anything imports torch (its OpenMP reads it once, at load). With a thread per core, each process's idle
# thread spins waiting for work while the other processes beside it (two CI lanes, a session's ranks) need the cores:
# measured on 2 cores beside another session, tests/test_losses*.py took 114 CPU s with the default, 37 with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
KEY_DISTS = ("torch", "transformers", "accelerate", "deepspeed", "trl")


def tool(name: str):
    """A module of tools/ (which is no package), loaded once by path: ``count_survey``, ``frameworks/swift_suite``
    (registered under its file's name)."""
    import importlib.util

    key = Path(name).name
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def stack_pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / f"{name}.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            dist, version = line.split("==", 1)
            pins[dist.strip().lower()] = version.strip()
    return pins


# The order in which CI (.ci/run) runs the stacks: a test about one catalogue entry that needs no more than one stack
# in its range runs on the first of them (home_stack), so that it runs once in CI and on the newest releases it can.
CI_ORDER = ("latest", "2026-04", "2025-12", "2025-10", "2025-01", "2024-11", "trl160", "trl1100", "swift",
            "llamafactory", "axolotl")
# stacks CI does not run (its time): their tests by hand, `make test-all STACK=<stack> PYTEST_ARGS=--own`
BY_HAND = ("trl151-ds0154", "trl1142")


def home_stack(dist: str, affected: str, needs=()) -> str | None:
    """The first stack of CI_ORDER (then BY_HAND) whose pin of ``dist`` is in ``affected`` and that pins every dist of ``needs``."""
    from zerofix import versions

    for name in CI_ORDER + BY_HAND:
        pins = stack_pins(name)
        if (dist in pins and versions.version_in_range(pins[dist], affected)
                and all(need in pins for need in needs)):
            return name
    return None


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def stack_mismatches(name: str) -> list[str]:
    pins = stack_pins(name)
    return [f"{d} {installed(d)} != {pins[d]}" for d in KEY_DISTS if d in pins and installed(d) != pins[d]]


def detect_stack() -> str | None:
    for path in sorted((ROOT / "constraints").glob("*.txt")):
        if not stack_mismatches(path.stem):
            return path.stem
    return None


def pytest_addoption(parser):
    parser.addoption("--stack", default="auto",
                     help="stack whose regression tests run (default: detected from installed versions)")
    parser.addoption("--own", action="store_true",
                     help="only the tests that name this stack in their stack mark (CI on every stack but latest, "
                          "which runs the rest once)")
    parser.addoption("--no-fork-server", action="store_true",
                     help="every forked session starts its own interpreter, as zerofix check does (default: they "
                          "fork from a server that imported the libraries once: zerofix.check.host.forkserver)")


def pytest_configure(config):
    name = config.getoption("--stack")
    if name == "auto":
        name = detect_stack()
    elif not (ROOT / "constraints" / f"{name}.txt").exists():
        raise pytest.UsageError(f"--stack {name}: no constraints/{name}.txt")
    elif stack_mismatches(name):
        raise pytest.UsageError(f"--stack {name} but this interpreter has {', '.join(stack_mismatches(name))}; "
                                f"run it with .venvs/{name}/bin/python (make test STACK={name})")
    config._zerofix_stack = name
    if not config.getoption("--no-fork-server"):
        from zerofix.check import launch
        from zerofix.check.host import forkserver

        # The suite's forked sessions (the batch, each runner.alone) fork from a server that imported the libraries
        # once per environment, instead of each starting an interpreter (8 - 12 CPU s of imports each; issue 68).
        launch.fork_server = forkserver.Pool()


def pytest_unconfigure(config):
    from zerofix.check import launch

    if launch.fork_server is not None:
        launch.fork_server.close()
        launch.fork_server = None
    if "preimported" in sys.modules:  # run_python's servers (a prelude's)
        sys.modules["preimported"].close()


def pytest_report_header(config):
    return f"zerofix stack: {config._zerofix_stack or 'none (stack tests skipped)'}"


@pytest.hookimpl(trylast=True)  # after -m has deselected what it deselects
def pytest_collection_modifyitems(config, items):
    stack = config._zerofix_stack
    for item in items:
        marker = item.get_closest_marker("stack")
        if marker and stack not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"runs on stack {'/'.join(marker.args)}, this is {stack}"))
        elif item.get_closest_marker("stack_independent") and stack not in (None, "latest"):
            item.add_marker(pytest.mark.skip(reason="depends on no library the stacks differ in (torch is the same build "
                                                    "on every stack): runs on latest (CI time)"))
    if config.getoption("--own"):
        # CI on every stack but latest: a stack runs the tests about its own releases (those whose stack mark names
        # it); a test with no stack mark depends on no release a stack pins apart, and runs once, on latest.
        others = [item for item in items if stack not in _named_stacks(item)]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if stack in _named_stacks(item)]
    # A smoke test that re-runs a few cells of its module's matrix is only worth its time when the matrix
    # itself is not selected (the fast tier): next to the full tier it would train the same cells twice.
    full = {item.module.__name__ for item in items
            if item.get_closest_marker("distributed") and not item.get_closest_marker("smoke")}
    redundant = [item for item in items if item.module.__name__ in full
                 and any(m.kwargs.get("subset_of_matrix") for m in item.iter_markers("smoke"))]
    if redundant:
        config.hook.pytest_deselected(items=redundant)
        items[:] = [item for item in items if item not in redundant]
    config._zerofix_requests = [r for item in items if not item.get_closest_marker("skip")
                                for r in declared_requests(item, stack)]


def _named_stacks(item) -> tuple:
    marker = item.get_closest_marker("stack")
    return marker.args if marker else ()


def uses(builder):
    """``@uses(builder)``: the ``ranks`` mark (a function as a mark's only argument would be taken for the marked
    test itself)."""
    return pytest.mark.ranks.with_args(builder)


def declared_requests(item, stack) -> list:
    """The requests of a test's ``ranks`` markers, built from its parameters and the stack."""
    import inspect

    params = {**getattr(getattr(item, "callspec", None), "params", {}), "stack": stack}
    out = []
    for marker in item.iter_markers("ranks"):
        builder = marker.args[0]  # its parameters named like the test's (a defaulted one may be left out)
        out += builder(**{name: params[name] for name in inspect.signature(builder).parameters if name in params})
    return out


@pytest.fixture(scope="session")
def ranks(request, tmp_path_factory):
    """The batch of the session's distributed runs, every declared request run (at the first use)."""
    from zerofix.check import runner

    # The ranks forked after one import (zerofix.check.session.fork_ranks), as zerofix check starts them: a launch then
    # costs one import instead of torchrun's agent and one per rank (tests/test_session.py holds the records of both
    # launchers bitwise equal; the tests of activation through a launcher still start torchrun themselves).
    batch = runner.Batch(tmp_path_factory.mktemp("ranks"), fork=True)
    batch.add(*getattr(request.config, "_zerofix_requests", ()))
    request.config._zerofix_batch = batch
    batch.run()
    return batch


def pytest_terminal_summary(terminalreporter, config):
    """Where the batch's time went (pytest's durations show it as one fixture's setup): per session, the ranks'
    start-up and the longest runs, wall seconds (CPU seconds of the busiest rank)."""
    batch = getattr(config, "_zerofix_batch", None)
    if batch is None:
        return
    terminalreporter.section("the batch of distributed runs")
    for ranks_, launches in batch.timings().items():
        for launch_ in launches:
            ready = max((r["ready"] or [0, 0] for r in launch_["ranks"]), key=lambda r: r[0])
            runs = {}
            for rank in launch_["ranks"]:
                for name, (wall, cpu) in rank["runs"].items():
                    runs[name] = max(runs.get(name, (0, 0)), (wall, cpu))
            total = sum(w for w, _ in runs.values())
            terminalreporter.write_line(f"session of {ranks_} rank(s), {launch_['launch']}: ranks ready after "
                                        f"{ready[0]:.1f} s, {len(runs)} runs in {total:.1f} s")
            for name, (wall, cpu) in sorted(runs.items(), key=lambda kv: -kv[1][0])[:8]:
                terminalreporter.write_line(f"  {wall:7.2f} s ({cpu:.2f} s CPU)  {name}")


@pytest.fixture(scope="session")
def stack(request):
    return request.config._zerofix_stack


def run_python(code: str, *, env: dict | None = None, cwd=None, timeout: float = 120,
               check: bool = True, args=(), prelude: str | None = None) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter (the one running the tests), ZEROFIX_* cleared unless given. ``prelude``:
    the program is ``prelude + code``, forked from a server that ran the prelude once (tests/preimported.py): for a
    test that runs one program many times, its imports in the prelude."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))}
    full_env.update(env or {})
    if prelude is not None:
        import preimported

        proc = preimported.run(textwrap.dedent(prelude), textwrap.dedent(code), env=full_env, cwd=cwd, args=args,
                               timeout=timeout)
    else:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=full_env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc
