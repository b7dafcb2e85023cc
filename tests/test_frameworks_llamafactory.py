"""Issue 53: zerofix where users launch it. LLaMA-Factory 0.9.5's own command line (``llamafactory-cli train
config.yaml``) on a tiny local Llama, GA 4 x 2 against the big batch on the same samples, one SGD step, fp32,
unpatched and with ``ZEROFIX=1`` (zerofix reaches the run through its ``.pth``, as it reaches a user's).

- SFT and DPO (sigmoid) are right upstream and stay right, bitwise, with ``ZEROFIX=1``; SFT on two processes under
  ZeRO-3 (LLaMA-Factory's own torchrun launch and ``ds_z3_config.json``'s keys) too.
- ``use_asft_loss``: LLaMA-Factory's compute_loss drops the count the Trainer hands it, so upstream sums the window's
  micro-batch means (the measured bug: about 4.6x the big batch's update). zerofix scales that loss as a micro-batch
  mean: closer to the big batch, still a mean of micro-batch means (the loss's DFT term is a token mean over its own
  micro-batch, which zerofix cannot hand a count), said in one WARNING that names the term and the fix.
- docs/frameworks.md's generated table holds these rows as this run measures them.

The other rows (DFT, packing, ORPO, SimPO, DPO with an SFT term, KTO, reward modelling, DDP and ZeRO-2) are a tool:
``tools/frameworks/llamafactory_suite.py``; docs/frameworks.md holds their measured table.
"""
from __future__ import annotations

import json

import pytest

from conftest import tool as conftest_tool

pytestmark = [pytest.mark.distributed, pytest.mark.stack("llamafactory")]
RIGHT = 1e-4


def test_llamafactory_zero3_sft_is_right_with_zerofix_and_asft_is_closer_and_said(tmp_path, capsys):
    # CI time (issue 68): SFT under ZeRO-3 (the DeepSpeed engine in the path) and ASFT here; the plain SFT and DPO rows,
    # measured the same way, are the tool's (docs/frameworks.md): `llamafactory_suite.py OUT sft dpo`
    tool = conftest_tool("frameworks/llamafactory_suite").FRAMEWORK
    assert tool.main([str(tmp_path), "asft", "sft@zero3", "--jobs", "2"]) == 0
    print(capsys.readouterr().out)
    results = {r["row"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for row in ("sft@zero3",):
        plain, fixed = results[row]["plain"], results[row]["zerofix"]
        assert "error" not in plain and "error" not in fixed, (row, plain, fixed)
        assert plain["rel"] < RIGHT and plain["ratio"] == pytest.approx(1.0, abs=1e-4), (row, plain)  # upstream: right
        assert results[row]["bitwise_as_unpatched"] is True, (row, results[row])  # no harm
        lines = results[row]["zerofix_lines"]
        # LLaMA-Factory's console says it, once ("1 fix acts" on a dense model since issue 58: not the MoE entry)
        assert sum("fixes act on this run" in line or "fix acts on this run" in line for line in lines) == 1, lines
    zero3 = "\n".join(results["sft@zero3"]["zerofix_lines"])
    assert "(through DeepSpeed)" in zero3 and "(ZeRO-3)" in zero3, zero3  # the DeepSpeed engine really ran

    asft = results["asft"]
    plain, fixed = asft["plain"], asft["zerofix"]
    assert plain["ratio"] > 3.5 and plain["rel"] > 1, plain  # upstream: the window's micro-batch means summed
    assert fixed["ratio"] == pytest.approx(plain["ratio"] / 4, rel=1e-6), fixed  # zerofix: their mean
    assert fixed["cosine"] == pytest.approx(plain["cosine"], abs=1e-6) and fixed["rel"] < plain["rel"] / 4, fixed
    said = [line for line in asft["zerofix_lines"] if "averages a term over its own micro-batch" in line]
    assert len(said) == 1 and "independent of num_items_in_batch" in said[0], asft["zerofix_lines"]
    assert "make that term a sum divided by the window's count" in said[0], said
    assert "(the Trainer's own path gave 4x that)" in said[0], said  # as measured: upstream's ratio / zerofix's
    assert not [line for line in asft["zerofix_lines"] if "scales it as a micro-batch mean" in line and
                line not in said], asft["zerofix_lines"]  # one WARNING says both

    for row in ("asft",):  # docs/frameworks.md's generated table (llamafactory_suite.py --write-docs)
        assert tool.doc_rows().get(row) == tool.table_row(results[row]), (tool.doc_rows().get(row), results[row])


def test_llamafactory_vision_language_sft_trains_the_token_mean_with_zerofix(tmp_path, capsys):
    """Issue 67: with a processor, LLaMA-Factory's SFT trainer sets ``model_accepts_loss_kwargs = False`` (#7448), so a
    Qwen2-VL run with images averages micro-batch means upstream, full and LoRA. ``llamafactory-processor-withheld-count``
    records that the framework's code set it, and the Trainer entry hands the count and checks it at every step: the
    big batch's update with ``ZEROFIX=1`` alone, said once in LLaMA-Factory's console as the entry's line."""
    tool = conftest_tool("frameworks/llamafactory_suite").FRAMEWORK
    # CI time (issue 68): the full model here; LoRA, measured the same way, is the tool's row: `llamafactory_suite.py OUT
    # vlm-lora`
    assert tool.main([str(tmp_path), "vlm"]) == 0
    print(capsys.readouterr().out)
    results = {r["row"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for row in ("vlm",):
        plain, fixed = results[row]["plain"], results[row]["zerofix"]
        assert "error" not in plain and "error" not in fixed, (row, plain, fixed)
        assert plain["rel"] > 0.1 and plain["cosine"] < 0.99, (row, plain)  # upstream: a mean of micro-batch means
        assert fixed["rel"] < RIGHT and fixed["ratio"] == pytest.approx(1.0, abs=1e-4), (row, fixed)  # the big batch
        said = [line for line in results[row]["zerofix_lines"]
                if "llamafactory-processor-withheld-count acts on this run (llamafactory 0.9.5)" in line]
        assert len({line[line.index("zerofix: "):] for line in said}) == 1, results[row]["zerofix_lines"]
        assert "CustomSeq2SeqTrainer.__init__ set model_accepts_loss_kwargs = False; zerofix has the Trainer hand the " \
               "model num_items_in_batch, and its loss was divided by it in 4 of 4 backwards" in said[0], said
        assert tool.doc_rows().get(row) == tool.table_row(results[row]), (tool.doc_rows().get(row), results[row])
