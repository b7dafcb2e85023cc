"""The GPU tier's own code on the CPU (brief rule 4): tools/gpu_trainer_matrix.py's rows, as tests/test_gpu.py reads
them on a GPU machine, from real Trainer runs here.

- A ``--cuda`` run on a machine without a GPU trains on the CPU (transformers falls back silently); the table must
  say so for every head, not report the CPU's verdicts as the GPU's.
- The same run on the CPU (fp32, one process, no engine): the verdicts the CPU tests measure elsewhere
  (tests/test_trainer_scaling.py, tests/test_moe_aux_loss.py), read through the table's code.
"""
from __future__ import annotations


import pytest

from conftest import tool

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.stack("latest"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs tests/test_gpu.py instead")]


def matrix():
    return tool("gpu_trainer_matrix")


def test_a_cuda_row_that_trained_on_the_cpu_is_an_error():
    rows = matrix().one_run("none", "fp32", 1, cuda=True)
    assert [r["head"] for r in rows] == ["cls", "lm", "moe"], rows
    assert all(r.get("error") == "trained on ['cpu'], not the GPU" for r in rows), rows


def test_the_table_reads_the_cpu_verdicts():
    rows = {r["head"]: r for r in matrix().one_run("none", "fp32", 1, cuda=False)}
    assert set(rows) == {"cls", "lm", "moe"} and not any("error" in r for r in rows.values()), rows
    # transformers 5.23, one process: the classifier's loss ignores the count (GAS x too large), the causal LM's
    # is right upstream, the router term is weighted GAS x
    assert rows["cls"]["verdict"] == "fixed" and rows["cls"]["unpatched"] == pytest.approx(4.0, rel=1e-3), rows
    assert rows["lm"]["verdict"] == "right (unchanged)" and rows["lm"]["bitwise_as_unpatched"], rows
    assert rows["moe"]["verdict"] == "fixed", rows
    assert all(r["device"] == ["cpu"] for r in rows.values()), rows


def test_issue_51s_gpu_rows_read_on_the_cpu():
    """tools/gpu_issue51.sh's Trainer rows through the table's code on the CPU (fp32): every row bitwise unchanged (the
    handed step run again included), right but the loss weight of GAS, which issue 58 leaves as upstream computes it (a
    coincidence, not a statement)."""
    m = matrix()
    rows = {r["head"]: r for r in m.one_run("none", "fp32", 1, cuda=False, cells=m.ISSUE51_CELLS)}
    assert set(rows) == {c["name"] for c in m.ISSUE51_CELLS} and not any("error" in r for r in rows.values()), rows
    weighted = rows.pop("times-steps")
    assert weighted["verdict"] == "STILL WRONG" and weighted["bitwise_as_unpatched"], weighted
    assert rows.pop("inline-mean")["verdict"] == "fixed"  # issue 59: its inline mean proven and weighed
    assert all(r["verdict"] == "right (unchanged)" and r["bitwise_as_unpatched"] for r in rows.values()), rows


@pytest.mark.parametrize("engine,dtype", [("none", "fp32"), ("fsdp2", "bf16")])
def test_issue_59s_gpu_rows_read_on_the_cpu(engine, dtype):
    """tools/gpu_issue59.sh's Trainer rows through the table's code on the CPU: the count handed on to the loss
    function and the inline mean proven and weighed are fixed (the token mean); the head with no logits to prove its
    mean from is upstream's mean of means, bitwise. FSDP2 in bf16 hands the loss back in bf16 (its mixed precision
    casts the forward's outputs): the H200 found the inline mean unproven there, STILL WRONG, before the proof took the
    loss's dtype into account."""
    m = matrix()
    rows = {r["head"]: r for r in m.one_run(engine, dtype, 1, cuda=False, cells=m.ISSUE59_CELLS)}
    assert set(rows) == {c["name"] for c in m.ISSUE59_CELLS} and not any("error" in r for r in rows.values()), rows
    assert rows["own-mean-llama"]["verdict"] == rows["inline-mean-llama"]["verdict"] == "fixed", rows
    assert rows["fused-mean-llama"]["verdict"] == "right (unchanged)", rows
    assert rows["fused-mean-llama"]["bitwise_as_unpatched"], rows


def test_issue_58s_gpu_rows_read_on_the_cpu():
    """tools/gpu_issue58.sh's Trainer rows through the table's code on the CPU (fp32, transformers 5.24): every update
    upstream's, bitwise; right where upstream is (the mean / GAS through a compute_loss_func), the others as upstream
    leaves them (a loss weight of GAS, four mean terms over 4, a double division)."""
    m = matrix()
    rows = {r["head"]: r for r in m.one_run("none", "fp32", 1, cuda=False, cells=m.ISSUE58_CELLS)}
    assert set(rows) == {c["name"] for c in m.ISSUE58_CELLS} and not any("error" in r for r in rows.values()), rows
    assert all(r["bitwise_as_unpatched"] for r in rows.values()), rows
    assert rows.pop("func-steps-divided-mean")["verdict"] == "right (unchanged)"
    assert all(r["verdict"] == "STILL WRONG" for r in rows.values()), rows
