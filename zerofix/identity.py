"""A weak mapping keyed by object identity, for what zerofix keeps beside a user's object (a trainer, an accelerator,
a model) without holding it alive or asking it to hash: TRL 0.29's ``KTOTrainer`` defines ``__eq__`` without
``__hash__``, so a ``WeakKeyDictionary`` keyed on it raised ``TypeError: unhashable type`` inside the Trainer's own
loop (issue 53, measured with ``ZEROFIX=1``). Plain Python; imports nothing of zerofix's."""
from __future__ import annotations

import weakref


class WeakIdentityMap:
    """``key -> value`` for as long as ``key`` lives, compared by ``is``; a key that cannot be weakly referenced
    raises ``TypeError`` on insertion (as ``WeakKeyDictionary`` does)."""

    __slots__ = ("_data",)

    def __init__(self):
        self._data: dict[int, tuple] = {}  # id(key) -> (weak reference to key, value)

    def _entry(self, key):
        entry = self._data.get(id(key))
        return entry if entry is not None and entry[0]() is key else None

    def get(self, key, default=None):
        entry = self._entry(key)
        return default if entry is None else entry[1]

    def __contains__(self, key) -> bool:
        return self._entry(key) is not None

    def __getitem__(self, key):
        entry = self._entry(key)
        if entry is None:
            raise KeyError(key)
        return entry[1]

    def __setitem__(self, key, value) -> None:
        data, at = self._data, id(key)

        def forget(ref, at=at, data=data):
            if data.get(at, (None,))[0] is ref:  # not an entry made since for a new object at the same address
                del data[at]

        self._data[at] = (weakref.ref(key, forget), value)

    def __delitem__(self, key) -> None:
        if self._entry(key) is None:
            raise KeyError(key)
        del self._data[id(key)]

    def pop(self, key, default=None):
        entry = self._entry(key)
        if entry is None:
            return default
        del self._data[id(key)]
        return entry[1]

    def setdefault(self, key, default=None):
        entry = self._entry(key)
        if entry is not None:
            return entry[1]
        self[key] = default
        return default

    def values(self) -> list:
        return [value for ref, value in list(self._data.values()) if ref() is not None]

    def __len__(self) -> int:
        return len(self.values())
