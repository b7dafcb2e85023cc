"""A DeepSpeed op build that was killed leaves its lock behind, and every later launch waits on it.

torch's ``cpp_extension`` guards a JIT build with a ``lock`` file in the op's build directory (created
exclusively, removed when the build ends); a process that finds it waits until it disappears. A check or a
training run interrupted while DeepSpeed builds its CPU op (the first launch in a fresh extensions directory)
leaves the file, and every later DeepSpeed launch there waits until its timeout. The pre-flight looks for such
files in the directory the check's ranks use: one older than a build can take, in a directory no live process
works in (a build's compiler runs there), is removed and named; a younger one is named with the command that
removes it. Plain code (tests/test_check.py).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

STALE_AFTER = 600  # seconds: DeepSpeed's CPU op builds in about a minute on 2 cores


def _busy_dirs() -> set[str]:
    """The working directories of the live processes (Linux /proc; empty where it cannot be read)."""
    busy = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            busy.add(os.path.realpath(entry / "cwd"))
        except OSError:
            continue
    return busy


def clear_stale(extensions_dir, *, now: float | None = None, busy=None) -> list[str]:
    """Look at ``<extensions_dir>/*/lock``: remove the stale ones; one message per lock found."""
    root = Path(extensions_dir)
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    busy = _busy_dirs() if busy is None else busy
    messages = []
    for lock in sorted(root.glob("*/lock")):
        age = now - lock.stat().st_mtime
        if age >= STALE_AFTER and os.path.realpath(lock.parent) not in busy:
            try:
                lock.unlink()
                messages.append(f"removed {lock}, left {age / 60:.0f} min ago by an interrupted DeepSpeed build "
                                "(every later launch would have waited on it)")
                continue
            except OSError as exc:
                messages.append(f"{lock} is left by an interrupted DeepSpeed build and could not be removed ({exc}): "
                                f"rm {lock}")
                continue
        messages.append(f"{lock} exists: a DeepSpeed build is running there, or was interrupted; if no zerofix "
                        f"check or training run is building, rm {lock} (else the launches wait on it)")
    return messages
