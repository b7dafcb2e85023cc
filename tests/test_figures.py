"""Issue 42, item 5: every run time and pasted output the user-facing pages show comes from one measured file,
docs/figures.json, which tools/figures.py writes; these tests hold the pages to it, so a page cannot drift from the
last measurement (before, the same check read 10 s, 15 s and 28 s in three places, `make test` 100 s, "about 1 min"
and "under 3 minutes", the CI limit 45 minutes in .ci/run and 30 in docs/development.md)."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT, tool

pytestmark = pytest.mark.stack_independent
# A duration in prose: "36 s", "0.1 s", "5 minutes", "2 min"
DURATION = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|seconds?|min|minutes?)\b")
# Durations that are settings or limits, not measurements (a scenario's timeout, the hung-run rule)
NOT_MEASURED = ("--timeout", "timeout", "hung", "3 x the patched run", "at least 30 s", "under 3 minutes")


def figures():
    return tool("figures")


def prose(text: str) -> str:
    """A page without its fenced blocks and its marked figures."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return figures().INLINE.sub("", text)


def test_every_marked_place_equals_the_measured_file():
    assert figures().differences() == []


def test_every_figure_is_shown_and_every_shown_figure_is_measured():
    f = figures()
    data = f.load()
    measured = set(data["figures"]) | set(data["outputs"])
    derived = {n for n in data["figures"] if n.startswith(("check_trl_rows_", "ci_")) and n != "ci_target_min"}
    assert f.used_names() <= measured
    assert measured - f.used_names() - derived == set()  # the per-step CI times and TRL totals are kept, not shown
    for figure in list(data["figures"].values()) + list(data["outputs"].values()):
        assert {"measured", "commit", "machine", "how"} <= set(figure), figure


@pytest.mark.parametrize("page", ["README.md", "docs/check.md"])
def test_no_time_on_the_user_pages_outside_the_measured_file(page):
    lines = [line for line in prose((ROOT / page).read_text()).splitlines()
             if DURATION.search(line) and not any(s in line for s in NOT_MEASURED)]
    assert lines == []


def test_a_checks_total_and_its_figure_agree():
    f = figures()
    data = f.load()
    for figure, output in (("check_2026_04_s", "check-output: 2026-04"), ("check_latest_s", "check-output: latest"),
                           ("own_config_2026_04_s", "own-config-output: 2026-04 zero2-offload")):
        assert f._total(data["outputs"][output]["text"]) == data["figures"][figure]["value"], figure


def test_cis_limit_is_one_number():
    limit = figures().load()["figures"]["ci_target_min"]["value"]
    assert f"keeping CI under {limit:g} minutes" in (ROOT / ".ci" / "run").read_text()


def test_the_check_help_states_no_time():
    import argparse

    from zerofix.check import command

    parser = argparse.ArgumentParser(prog="zerofix check")
    command.add_arguments(parser)
    helps = [a.help for a in parser._actions if a.help]
    assert not [h for h in helps if DURATION.search(h) and "--timeout" not in h and "S seconds" not in h]


def test_render_writes_what_check_then_accepts(tmp_path, monkeypatch):
    """The script's own round trip: a page whose figure differs is rewritten to the measured value."""
    f = figures()
    data = {"figures": {"x_s": {"value": 12.5, "unit": "s"}, "y_s": {"value": 2456, "unit": "s+min"}},
            "outputs": {"check-output: demo": {"text": "$ zerofix check\nh1\nh2\nh3\nrow\n"}}}
    page = ("a <!-- fig x_s -->9 s<!-- /fig --> b <!-- fig y_s -->1 s<!-- /fig -->\n"
            "<!-- check-output: demo (no header) -->\n```\nold\n```\n")
    new, missing = f.rendered(page, data)
    assert missing == []
    assert new == ("a <!-- fig x_s -->12.5 s<!-- /fig --> b <!-- fig y_s -->2456 s (41 min)<!-- /fig -->\n"
                   "<!-- check-output: demo (no header) -->\n```\nrow\n```\n")
    assert f.rendered(new, data)[0] == new
    assert f.rendered("<!-- fig z -->1 s<!-- /fig -->", data)[1] == ["z"]
