"""tools/frameworks/swift_suite.py's generated docs table (issue 53, item 1), without running ms-swift: a row's cells and
what zerofix said, rows merged by name into the table between its markers in a fixed order, the rest of the page kept."""
from __future__ import annotations

import pytest

from conftest import tool

pytestmark = pytest.mark.stack_independent


def suite():
    return tool("frameworks/swift_suite")


def result(row, rel=1e-7, lines=()):
    measured = {"ratio": 1.0, "cosine": 1.0, "rel": rel}
    return {"row": row, "judged": row != "kto", "plain": measured, "zerofix": measured, "zerofix_lines": list(lines)}


def test_rows_are_written_between_the_markers_merged_and_ordered(tmp_path):
    tool = suite()
    page = tmp_path / "frameworks.md"
    page.write_text(f"# before\n\n{tool.BEGIN}\n{tool.END}\n\nafter\n")
    tool.write_docs([result("dpo@ddp"), result("sft", lines=["zerofix: X's loss averages a term over its own "
                                                               "micro-batch (...)"])], page)
    tool.write_docs([result("dpo", rel=0.2, lines=["... read as already per accumulation window ..."])], page)
    text = page.read_text()
    assert text.startswith("# before\n") and text.endswith("\nafter\n")
    rows = tool.doc_rows(page)
    assert list(rows) == ["sft", "dpo", "dpo@ddp"]  # one process first, in ROWS order, then the layouts
    assert rows["sft"] == "| `sft` | 1.0000 / 1.0000 right | 1.0000 / 1.0000 right | WARNING: a micro-batch mean term |"
    assert rows["dpo"].endswith("wrong | 1.0000 / 1.0000 wrong | loss read as per window |")
    assert tool.table_row(result("kto")) == "| `kto` | 1.0000 / 1.0000 | 1.0000 / 1.0000 | - |"  # not judged


def test_row_names_and_the_real_page():
    tool = suite()
    assert tool.split("sft@zero2") == ("sft", "zero2") and tool.split("dpo") == ("dpo", None)
    assert tool.reference_name("dpo@ddp") == "dpo@16" and tool.reference_name("dpo") == "dpo"
    with pytest.raises(SystemExit, match="unknown row"):
        tool.split("sft@fsdp")
    documented = tool.doc_rows()  # docs/frameworks.md carries the generated table
    assert {"sft", "dpo", "orpo", "sft@ddp", "dpo@zero2"} <= set(documented), sorted(documented)
