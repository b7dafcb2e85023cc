"""zerofix.identity.WeakIdentityMap: what zerofix keeps beside a user's object, by identity and weakly (issue 53: TRL
0.29's KTOTrainer defines __eq__ without __hash__, and a WeakKeyDictionary keyed on it raised in the Trainer's loop)."""
from __future__ import annotations

import gc

import pytest

from zerofix.identity import WeakIdentityMap

pytestmark = pytest.mark.stack_independent


class Unhashable:
    def __eq__(self, other):  # as KTOTrainer: __eq__ without __hash__ makes instances unhashable
        return True


def test_an_unhashable_key_is_kept_by_identity_and_forgotten_when_it_dies():
    m, a, b = WeakIdentityMap(), Unhashable(), Unhashable()
    with pytest.raises(TypeError):
        hash(a)
    m[a] = 1
    assert a in m and b not in m and m.get(a) == 1 and m.get(b, 2) == 2 and m[a] == 1
    assert m.setdefault(b, 3) == 3 and sorted(m.values()) == [1, 3] and len(m) == 2
    del b
    gc.collect()
    assert m.values() == [1] and len(m) == 1
    assert m.pop(a) == 1 and a not in m and m.pop(a, "gone") == "gone"
    with pytest.raises(KeyError):
        del m[a]


def test_a_value_is_not_held_by_its_dead_key():
    m = WeakIdentityMap()
    key = Unhashable()
    m[key] = [1, 2]
    address = id(key)
    del key
    gc.collect()
    assert address not in m._data
