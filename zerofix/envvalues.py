"""The values the ZEROFIX_* variables take, and the one a fix reads at run time: a leaf (imports nothing), so the
fixes read the environment without importing the activation machinery that loads them."""
from __future__ import annotations

import os

OFF = ("0", "false", "off", "no")
ALL = ("1", "all", "true", "on", "yes")
STATEMENT = "ZEROFIX_LOSS_IS_SCALED_FOR_GA"
HAND_COUNT = "ZEROFIX_HAND_COUNT_TO_MODEL"


def loss_statement(environ=None) -> bool | None:
    """``ZEROFIX_LOSS_IS_SCALED_FOR_GA``: True (1/true/on/yes/all), False (0/false/off/no), or None (unset or malformed:
    the malformed value is named once by the activation's warnings)."""
    env = os.environ if environ is None else environ
    value = env.get(STATEMENT, "").strip().lower()
    return True if value in ALL else False if value in OFF else None


def hand_count_statement(environ=None) -> bool:
    """``ZEROFIX_HAND_COUNT_TO_MODEL``: True (1/true/on/yes/all) where the user says that a trainer's own
    ``model_accepts_loss_kwargs = False`` is not theirs (axolotl 0.19 sets it for every model) and the model's loss should
    be handed the count; anything else False (a malformed value is named once by the activation's warnings)."""
    env = os.environ if environ is None else environ
    return env.get(HAND_COUNT, "").strip().lower() in ALL
