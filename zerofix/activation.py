"""Activation from the environment: the entry point of the ``.pth`` file and of ``zerofix run``.

Precedence: explicit ``zerofix.patch()`` arguments > environment > defaults. Variables:

- ``ZEROFIX``: ``1``/``all``/``true``/``on``/``yes`` = every default fix; a comma list of fix ids = those;
  ``0``/``false``/``off``/``no``/unset = off (under ``zerofix run`` unset means on).
- ``ZEROFIX_DISABLE``: comma list of fix ids to leave alone.
- ``ZEROFIX_OPT_IN``: comma list of opt-in fix ids to apply too (``ZEROFIX=1`` applies every entry but those).
- ``ZEROFIX_LOG``: ``debug``/``info``/``warning``: log zerofix's decisions to stderr at that level.
- ``ZEROFIX_STRICT``: ``1`` raises when a fix's target changed instead of skipping it.
- ``ZEROFIX_LOSS_IS_SCALED_FOR_GA``: what every Trainer's loss is, for a user who launches a framework's command line
  and cannot call ``zerofix.loss_is_scaled_for_ga(trainer)``: ``1`` already per accumulation window (normalised by the
  window's count, or divided by ``gradient_accumulation_steps``), ``0`` a micro-batch mean. Unset: measured.
- ``ZEROFIX_HAND_COUNT_TO_MODEL``: ``1`` says that a trainer's own ``model_accepts_loss_kwargs = False`` (axolotl 0.19's
  trainer sets it for every model) is not the user's word: zerofix hands the model's loss the count, as it does for a
  head whose class says ``accepts_loss_kwargs = False``, and keeps it only for steps whose loss is divided by it.
  Unset or ``0``: the trainer's setting is followed (and said where it averages micro-batch means).

A malformed ``ZEROFIX``, ``ZEROFIX_DISABLE`` or ``ZEROFIX_OPT_IN`` gets one warning naming the valid forms, and nothing is
patched (which fixes were meant is unclear). A malformed ``ZEROFIX_LOG`` or ``ZEROFIX_STRICT`` only
warns and falls back to its default: a typo in a log level must not turn the fixes off. Nothing here
may raise into interpreter start-up.
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple

from zerofix.envvalues import ALL, HAND_COUNT, OFF, STATEMENT

LOG_LEVELS = ("debug", "info", "warning")
VARIABLES = ("ZEROFIX", "ZEROFIX_DISABLE", "ZEROFIX_OPT_IN", "ZEROFIX_LOG", "ZEROFIX_STRICT", STATEMENT, HAND_COUNT)


class ConfigError(ValueError):
    pass


class Settings(NamedTuple):
    enabled: bool
    fixes: tuple[str, ...] | None  # None = every default fix (not the opt-in ones)
    disable: tuple[str, ...]
    log_level: str | None
    strict: bool
    warnings: tuple[str, ...] = ()  # malformed optional settings, replaced by their defaults
    opt_in: tuple[str, ...] = ()


def _id_list(name: str, value: str) -> tuple[str, ...]:
    from zerofix import catalogue

    items = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in items if v not in catalogue.ids()]
    if unknown or not items:
        forms = (f"Valid forms: {name}=1 (every default fix), {name}=0 (off), or a comma list of: " if name == "ZEROFIX"
                 else f"Valid form: {name}=a comma list of fix ids, from: ")
        raise ConfigError(
            f"{name}={value!r} is not valid: unknown fix id(s) {', '.join(unknown) or '(none given)'}"
            f"{catalogue.retired_note(unknown)}. "
            + forms + ", ".join(catalogue.ids())
        )
    return items


def read_environment(environ=None, *, default_on: bool = False) -> Settings:
    """Parse the ZEROFIX_* variables; raises ConfigError naming the valid forms."""
    env = os.environ if environ is None else environ
    raw = env.get("ZEROFIX")
    value = (raw or "").strip().lower()
    if raw is None or value == "":
        enabled, fixes = default_on, None
    elif value in OFF:
        enabled, fixes = False, None
    elif value in ALL:
        enabled, fixes = True, None
    else:
        enabled, fixes = True, _id_list("ZEROFIX", raw)

    disable_raw = env.get("ZEROFIX_DISABLE", "").strip()
    disable = _id_list("ZEROFIX_DISABLE", disable_raw) if disable_raw else ()
    opt_in_raw = env.get("ZEROFIX_OPT_IN", "").strip()
    opt_in = _id_list("ZEROFIX_OPT_IN", opt_in_raw) if opt_in_raw else ()

    warnings = []
    log_raw = env.get("ZEROFIX_LOG", "").strip().lower()
    if log_raw and log_raw not in LOG_LEVELS:
        warnings.append(f"ZEROFIX_LOG={env.get('ZEROFIX_LOG')!r} is not valid (use one of: {', '.join(LOG_LEVELS)}); "
                        "logging warnings only, the fixes still apply")
        log_raw = ""
    strict_raw = env.get("ZEROFIX_STRICT", "").strip().lower()
    if strict_raw and strict_raw not in OFF + ALL:
        warnings.append(f"ZEROFIX_STRICT={env.get('ZEROFIX_STRICT')!r} is not valid (use 1 or 0); not strict, "
                        "the fixes still apply")
        strict_raw = ""
    statement_raw = env.get(STATEMENT, "").strip().lower()
    if statement_raw and statement_raw not in OFF + ALL:
        warnings.append(f"{STATEMENT}={env.get(STATEMENT)!r} is not valid (use 1: the loss is already per "
                        "accumulation window, or 0: a micro-batch mean); ignored, zerofix measures what the loss is")
    hand_raw = env.get(HAND_COUNT, "").strip().lower()
    if hand_raw and hand_raw not in OFF + ALL:
        warnings.append(f"{HAND_COUNT}={env.get(HAND_COUNT)!r} is not valid (use 1: hand the model's loss the count a "
                        "trainer's own model_accepts_loss_kwargs = False withholds, or 0); ignored, the trainer's "
                        "setting is followed")
    for name in sorted(k for k in env if k.startswith("ZEROFIX_") and k not in VARIABLES):
        # a misspelt variable (ZEROFIX_FIXES for ZEROFIX) would otherwise be ignored without a word
        warnings.append(f"{name} is not a zerofix variable and is ignored (zerofix reads {', '.join(VARIABLES)}; "
                        "a list of fixes goes in ZEROFIX itself)")
    return Settings(enabled, fixes, disable, log_raw or None, strict_raw in ALL, tuple(warnings), opt_in)


_warned = False
# A warning said in this process is not said again by the processes it starts (a launcher's own start-up, then
# torchrun's, then every rank's, all read the same environment): the keys said so far travel in this variable.
SAID = "_ZEROFIX_SAID"


def said_already(message: str) -> bool:
    """Whether this process or one that started it already wrote ``message``; records it if not."""
    import zlib

    key = format(zlib.crc32(message.encode()), "08x")
    said = os.environ.get(SAID, "").split(",")
    if key in said:
        return True
    os.environ[SAID] = ",".join([k for k in said if k] + [key])
    return False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        if not said_already(message):
            sys.stderr.write(f"zerofix: warning: {message}; the environment activated no fix (an explicit "
                             "zerofix.patch() still applies what it is given).\n")


def _warn_setting(message: str) -> None:
    if not said_already(message):  # once per process tree
        sys.stderr.write(f"zerofix: warning: {message}.\n")


def strict_from_environment(environ=None) -> bool:
    """``ZEROFIX_STRICT`` for a ``patch()`` call that did not say: on only for 1/true/on/yes."""
    env = os.environ if environ is None else environ
    return env.get("ZEROFIX_STRICT", "").strip().lower() in ALL


def configure_logging(level: str) -> None:
    import logging

    from zerofix._log import logger

    log = logger()
    if not any(getattr(h, "_zerofix", False) for h in log.handlers):
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK")
        prefix = f"[zerofix rank {rank}]" if rank is not None else "[zerofix]"
        handler.setFormatter(logging.Formatter(prefix + " %(levelname)s %(message)s"))
        handler._zerofix = True
        log.addHandler(handler)
    log.setLevel(level.upper())


def autopatch(*, default_on: bool = False):
    """Patch according to the environment. Never raises (except StrictError when asked for)."""
    try:
        settings = read_environment(default_on=default_on)
    except ConfigError as exc:
        _warn_once(str(exc))
        return None
    if not settings.enabled:
        for message in settings.warnings:  # off, but a ZEROFIX_* variable that does not exist is still named
            if "is not a zerofix variable" in message:
                _warn_setting(message)
        return None
    for message in settings.warnings:
        _warn_setting(message)
    if settings.log_level:
        configure_logging(settings.log_level)
    from zerofix import patching
    from zerofix.errors import StrictError

    try:
        patching.patch(settings.fixes, settings.disable, opt_in=settings.opt_in, strict=settings.strict)
        return settings
    except StrictError:
        raise
    except Exception as exc:  # noqa: BLE001 - start-up must go on
        _warn_once(f"activation failed: {type(exc).__name__}: {exc}")
        return None
