"""Which release of a distribution is installed, and whether a release is in a PEP 440 range.

A leaf: the version guard (``patching``), the fixes that must know another entry's range, and ``zerofix
check``'s verdicts all read versions here. Imports are lazy (``importlib.metadata`` and ``packaging`` cost
milliseconds that interpreter start-up with ``ZEROFIX=1`` must not pay).
"""
from __future__ import annotations


_installed: dict[str, str | None] = {}  # dist -> version: a fact of the process's environment, read once


def installed_version(dist: str) -> str | None:
    """The installed version of ``dist`` (an importlib.metadata name), None when it is not installed.

    Read once a process: ``importlib.metadata`` parses the distribution's METADATA file at every call (about 1.7 ms
    here), and ``zerofix.status()``, which a Trainer's log and ``zerofix check``'s every run read, asks for each
    catalogue entry's distribution: 1,600 reads took 2.8 s of each rank's 15 s in the check's default run. A library
    installed or upgraded after its first read in a running process is not what that process imported anyway."""
    if dist in _installed:
        return _installed[dist]
    from importlib import metadata

    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = None
    _installed[dist] = version
    return version


def version_in_range(version: str, affected: str) -> bool:
    """Whether ``version`` is inside the PEP 440 specifier ``affected``, prereleases included: a
    ``5.9.0.dev0`` build must be judged by its number, not skipped."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(affected).contains(Version(version), prereleases=True)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"5.3.0"`` -> (5, 3, 0); ``"5.9.0.dev0"`` -> (5, 9, 0): the release numbers a rule compares."""
    from packaging.version import Version

    return Version(version).release
