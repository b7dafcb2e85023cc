"""What a fix's wrappers changed in this process, counted by kind, for the contract's ``runtime_details`` and
``reset_runtime`` (zerofix.fixes.contract). ``corrected`` is the total: 0 says the entry, though applied, met
nothing of its bug in this process, and ``zerofix check`` then does not name it as a fix of that row."""
from __future__ import annotations


class Changes:
    def __init__(self, *kinds: str):
        self._counts = dict.fromkeys(kinds, 0)

    def count(self, kind: str) -> None:
        self._counts[kind] += 1

    def runtime_details(self) -> list[dict]:
        return [{**self._counts, "corrected": sum(self._counts.values())}]

    def reset_runtime(self) -> None:
        self._counts = dict.fromkeys(self._counts, 0)
