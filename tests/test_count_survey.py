"""Issue 47's survey, regenerated: for every generation head of the installed transformers that says
``accepts_loss_kwargs = False``, what its loss does with the count when handed one (tools/count_survey.py, measured
on a tiny random instance). docs/count-survey.md holds one table per pinned stack; a table that no longer matches
the installed release's heads fails here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.stack("latest", "2026-04", "2025-10", "swift", "llamafactory")  # and the frameworks' releases (issue 59)
def test_the_documented_survey_is_the_measured_one():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "count_survey.py"), "--check"], capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
