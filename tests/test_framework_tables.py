"""tools/frameworks/swift_suite.py's generated docs table (issue 53, item 1), without running ms-swift: a row's cells and
what zerofix said, rows merged by name into the table between its markers in a fixed order, the rest of the page kept."""
from __future__ import annotations

import pytest

from conftest import tool

pytestmark = pytest.mark.stack_independent


def suite():
    return tool("frameworks/swift_suite").FRAMEWORK


def result(row, rel=1e-7, lines=()):
    measured = {"ratio": 1.0, "cosine": 1.0, "rel": rel}
    return {"row": row, "judged": row != "kto", "plain": measured, "zerofix": measured, "zerofix_lines": list(lines)}


def test_rows_are_written_between_the_markers_merged_and_ordered(tmp_path):
    tool = suite()
    page = tmp_path / "frameworks.md"
    begin, end = tool.markers()
    page.write_text(f"# before\n\n{begin}\n{end}\n\nafter\n")
    tool.write_docs([result("dpo@ddp"), result("sft", lines=["zerofix: X's loss averages a term over its own "
                                                               "micro-batch (...)"])], page)
    tool.write_docs([result("dpo", rel=0.2, lines=["... a coincidence, not a statement ..."])], page)
    text = page.read_text()
    assert text.startswith("# before\n") and text.endswith("\nafter\n")
    rows = tool.doc_rows(page)
    assert list(rows) == ["sft", "dpo", "dpo@ddp"]  # one process first, in ROWS order, then the layouts
    assert rows["sft"] == "| `sft` | 1.0000 / 1.0000 right | 1.0000 / 1.0000 right | WARNING: a micro-batch mean term |"
    assert rows["dpo"].endswith("wrong | 1.0000 / 1.0000 wrong | GAS read as a coincidence: upstream's update |")
    assert tool.table_row(result("kto")) == "| `kto` | 1.0000 / 1.0000 | 1.0000 / 1.0000 | - |"  # not judged


def test_row_names_and_the_real_page():
    tool = suite()
    assert tool.split("sft@zero2") == ("sft", "zero2") and tool.split("dpo") == ("dpo", None)
    assert tool.reference_name("dpo@ddp") == "dpo@16" and tool.reference_name("dpo") == "dpo"
    with pytest.raises(SystemExit, match="unknown row"):
        tool.split("sft@fsdp")
    documented = tool.doc_rows()  # docs/frameworks.md carries the generated table
    assert {"sft", "dpo", "orpo", "sft@ddp", "dpo@zero2"} <= set(documented), sorted(documented)


def test_the_llamafactory_suites_config_and_table(tmp_path):
    """llamafactory_suite.py's YAML for one run (the row's keys, the 16-sample data of a 2-process layout, the ZeRO
    layout's DeepSpeed config) and its table in the real page, without running LLaMA-Factory."""
    import json

    module = tool("frameworks/llamafactory_suite")
    out = tmp_path / "runs" / "asft@zero3" / "plain"
    out.parent.mkdir(parents=True)
    cmd = module.command(tmp_path, "asft", out, 4, 2, "zero3", sixteen=True)
    assert cmd[0].endswith("llamafactory-cli") and cmd[1] == "train"
    config = dict(line.split(": ", 1) for line in (tmp_path / cmd[2]).read_text().splitlines())
    assert config["use_asft_loss"] == "true" and config["dataset"] == '"sft16"' and config["stage"] == '"sft"'
    assert config["gradient_accumulation_steps"] == "4" and config["per_device_train_batch_size"] == "2"
    deepspeed = json.loads((tmp_path / json.loads(config["deepspeed"])).read_text())
    assert deepspeed["zero_optimization"]["stage"] == 3 and deepspeed["zero_allow_untested_optimizer"] is True
    assert "deepspeed" not in module.command(tmp_path, "dpo", out, 1, 8)[2]  # the big batch: one process, no ZeRO
    documented = module.FRAMEWORK.doc_rows()
    assert {"sft", "asft", "dpo", "rm", "sft@zero3", "dpo@zero3"} <= set(documented), sorted(documented)
    swift = suite().doc_rows()  # each framework's table between its own markers
    assert "asft" not in swift and "grpo" in swift and "grpo" not in documented


def test_the_axolotl_suites_config_and_table(tmp_path):
    """axolotl_suite.py's YAML for one run (fp32 set explicitly, the row's keys, the packed rows' one sequence a
    micro-batch, the 16-sample data and the torchrun launcher of a 2-process layout, zero2.json's keys) and its table
    in the real page, without running axolotl."""
    import json

    module = tool("frameworks/axolotl_suite")
    out = tmp_path / "runs" / "sft@zero2" / "plain"
    out.parent.mkdir(parents=True)
    cmd = module.command(tmp_path, "sft", out, 4, 2, "zero2", sixteen=True)
    assert cmd[0].endswith("axolotl") and cmd[1] == "train"
    assert cmd[3:7] == ["--launcher", "torchrun", "--", "--nproc_per_node"] and cmd[7] == "2"
    config = {k: json.loads(v) for k, v in (line.split(": ", 1) for line in (tmp_path / cmd[2]).read_text().splitlines())}
    assert (config["bf16"], config["fp16"], config["tf32"]) == (False, False, False)  # axolotl's bf16 default: auto
    assert config["datasets"][0]["path"].endswith("sft16.jsonl") and config["optimizer"] == "sgd"
    assert config["gradient_accumulation_steps"] == 4 and config["micro_batch_size"] == 2
    deepspeed = json.loads(open(config["deepspeed"]).read())
    assert deepspeed["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # axolotl's zero2.json
    assert deepspeed["zero_allow_untested_optimizer"] is True and deepspeed["zero_force_ds_cpu_optimizer"] is False
    packed = module.command(tmp_path, "packing", out, 1, 8)
    config = {k: json.loads(v) for k, v in (line.split(": ", 1) for line in (tmp_path / packed[2]).read_text().splitlines())}
    assert config["sample_packing"] is True and config["micro_batch_size"] == 4 and "deepspeed" not in config
    assert len(packed) == 3  # one process: axolotl's default launcher
    documented = module.FRAMEWORK.doc_rows()
    assert {"sft", "packing", "dpo", "orpo", "kto"} <= set(documented), sorted(documented)
    assert "asft" not in documented and "packing" not in suite().doc_rows()
