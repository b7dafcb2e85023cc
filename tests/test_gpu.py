"""The GPU tier (issue 39, item 4): the Trainer x {no engine, FSDP1, FSDP2, ZeRO-2, ZeRO-3} x {bf16, fp16} x
{classifier, causal LM} on CUDA, through tools/gpu_trainer_matrix.py. Marked ``gpu``: it skips without CUDA, and CI
has none (docs/fixes.md, "Paths", says what has and has not been measured on a GPU)."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU tier)")]


def matrix():
    spec = importlib.util.spec_from_file_location("gpu_trainer_matrix", ROOT / "tools" / "gpu_trainer_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_trainer_matrix", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("engine", ["none", "fsdp1", "fsdp2", "zero2", "zero3"])
def test_the_trainer_is_right_patched_on_every_gpu_engine(engine):
    rows = matrix().rows(1, engines=(engine,))
    for row in rows:
        if "skipped" in row:
            pytest.skip(row["skipped"])
        assert "error" not in row, row
        assert row["verdict"] in ("fixed", "right (unchanged)"), row
        if row["verdict"] == "right (unchanged)":
            assert row["bitwise_as_unpatched"] in (True, None), row


def test_the_table_names_each_verdict():
    """Runs anywhere the module imports (CUDA present): the verdict of each kind of row."""
    m = matrix()
    assert [m.verdict(1, 1, True, True), m.verdict(4, 1, False, True), m.verdict(1, 4, True, False),
            m.verdict(4, 4, False, False)] == ["right (unchanged)", "fixed", "HARMED", "STILL WRONG"]
