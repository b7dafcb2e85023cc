"""Who set a trainer's ``model_accepts_loss_kwargs = False``: the facts a framework entry records, kept beside the
trainer (issue 67).

The Trainer hands ``num_items_in_batch`` to the model's loss only while ``model_accepts_loss_kwargs`` is True. A
framework's trainer that sets it False in its own ``__init__`` makes every run of it under gradient accumulation train
on a mean of micro-batch means. Where the framework's own later release or an upstream issue or PR calls that a bug
(axolotl 0.17.0 - 0.19.x: PR #3982, 0.20.0 reads the loss function instead; LLaMA-Factory's processor flag: #7448 and
its open PR #10454), the catalogue has an entry for those releases, whose wrapper of the framework's ``__init__``
records here that the framework's code set the flag. Who decides what that means is ``zerofix.decision``
(``framework_word``); the Trainer entry asks it at a run's start.

A subclass from outside the framework whose own ``__init__`` runs around the framework's may set the flag itself, in
the same way: such a record names it (``around``), and the setting is then followed and said, as any user's is. Plain
code: imports nothing but the identity map.
"""
from __future__ import annotations

from typing import NamedTuple

from zerofix.identity import WeakIdentityMap


class FrameworkFlag(NamedTuple):
    """One trainer's flag, set False by a framework's own ``__init__`` on a release a catalogue entry names."""

    fix_id: str  # the catalogue entry of the framework's releases with the bug
    setter: str  # whose code set it: "AxolotlTrainer.__init__"
    release: str  # the framework's installed release: "axolotl 0.19.0"
    around: str | None = None  # a subclass ``__init__`` from outside the framework around it (it may set it too)


_flags = WeakIdentityMap()  # trainer -> FrameworkFlag


def record(trainer, flag: FrameworkFlag) -> None:
    """Keep ``flag`` beside ``trainer`` (a trainer that cannot be weakly referenced keeps none: its flag is then
    followed as anybody's)."""
    try:
        _flags[trainer] = flag
    except TypeError:
        pass


def of(trainer) -> FrameworkFlag | None:
    """The record of ``trainer``'s flag, or None where no framework entry recorded one."""
    return _flags.get(trainer)


def clear() -> None:
    """Forget every record (the framework entries were unpatched: nothing they recorded may act any more)."""
    global _flags
    _flags = WeakIdentityMap()
