"""zerofix's logger, imported lazily: ``logging`` is not needed to register hooks at start-up."""
from __future__ import annotations

_logger = None


def logger():
    global _logger
    if _logger is None:
        import logging

        _logger = logging.getLogger("zerofix")
    return _logger


def log(level: str, msg: str, *args) -> None:
    getattr(logger(), level)(msg, *args)
