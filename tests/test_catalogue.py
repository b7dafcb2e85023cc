"""The catalogue is valid data and the README's table says what it says."""
from __future__ import annotations

import pytest

import re

from packaging.specifiers import SpecifierSet

from conftest import ROOT
from zerofix import catalogue
from zerofix.cli import markdown_table

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


def test_entries_are_well_formed():
    assert len(set(catalogue.ids())) == len(catalogue.FIXES)
    for fix in catalogue.FIXES:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", fix.id), fix.id
        SpecifierSet(fix.affected)  # parses
        assert fix.targets and fix.modules  # the implementation contract: test_structure.py
        assert all(u.startswith("https://github.com/") for u in fix.upstream)


def test_readme_table_matches_the_catalogue():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- fix-table")[1].split("<!-- /fix-table -->")[0]
    assert markdown_table() in block, "regenerate the README table with: zerofix catalogue --markdown"


def test_unknown_id_error_lists_the_valid_ids():
    err = catalogue.unknown_ids_error({"nope"})
    assert "nope" in str(err) and all(i in str(err) for i in catalogue.ids())
