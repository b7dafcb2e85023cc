"""Files a rank writes for another process to read (its record, its error): whole or not at all.

A rank can be stopped at any moment (torchrun's agent and the session launcher stop the others once one fails), and
a file opened for writing is empty or half-written until its last byte: a reader then takes a half record for a result
(a ``JSONDecodeError`` where a rank's error was expected). Written aside and renamed, a file appears whole or not at
all (``os.replace`` is atomic within a file system), and a name that starts with a dot and ends in ``.part`` matches
none of the patterns the readers look for (``rank*.json``, ``rank*.error``, ``error.rank*``).
"""
from __future__ import annotations

import os
from pathlib import Path


def write_whole(path, text: str) -> None:
    """``path`` with ``text``, appearing at once (see the module docstring)."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.{os.getpid()}.part")
    aside.write_text(text)
    os.replace(aside, path)


def append_whole(path, line: str) -> None:
    """``line`` (and a newline) appended to ``path`` so that a reader sees every line whole: the file rewritten aside
    with it and renamed (the files it serves hold a few lines)."""
    path = Path(path)
    kept = path.read_text() if path.exists() else ""
    write_whole(path, kept + line + "\n")
