"""The tables of README.md and results/BENCHMARKS.md are what `python -m omnibench.tables` writes from
the committed records today, and the writer only ever touches what lies between
its markers."""

import pytest

from omnibench import tables
from omnibench.tables import TableError, registry, render, write

REGENERATE = "python -m omnibench.tables"


def test_committed_tables_are_what_the_script_writes_from_the_records():
    diffs = write(check=True, fast=True)
    assert not diffs, f"committed tables differ from the records; run `{REGENERATE}`:\n" + "\n".join(diffs)


@pytest.mark.slow
def test_committed_slow_tables_are_what_the_script_writes_from_the_records():
    slow = {name for name, t in registry().items() if t.slow}
    diffs = write(check=True, only=slow)
    assert not diffs, f"committed tables differ from the records; run `{REGENERATE}`:\n" + "\n".join(diffs)


def test_every_registered_table_appears_in_a_document():
    used = set()
    for doc in tables.DOCUMENTS:
        used |= set(tables.names_in((tables.REPO_ROOT / doc).read_text()))
    assert set(registry()) <= used, f"registered but quoted nowhere: {sorted(set(registry()) - used)}"


def test_a_block_table_replaces_only_what_lies_between_its_markers():
    text = "before\n<!-- table:t -->\nold | row\n<!-- /table -->\nafter <!-- table:u -->x<!-- /table --> end\n"
    out = render(text, {"t": "| a |\n|---|\n| 1 |\n", "u": "42%"}.get)
    assert out == "before\n<!-- table:t -->\n| a |\n|---|\n| 1 |\n<!-- /table -->\nafter <!-- table:u -->42%<!-- /table --> end\n"
    assert render(out, {"t": "| a |\n|---|\n| 1 |", "u": "42%"}.get) == out  # written twice: the same


def test_a_table_the_writer_leaves_out_keeps_its_committed_text():
    text = "<!-- table:t -->\nkept\n<!-- /table -->\n"
    assert render(text, lambda name: None) == text


def test_an_inline_marker_refuses_a_table_of_several_lines():
    with pytest.raises(TableError, match="inline"):
        render("x <!-- table:t --><!-- /table --> y", lambda name: "a\nb")


def test_an_unclosed_marker_is_named_with_its_line():
    with pytest.raises(TableError, match=r"doc.md:2: .*without its"):
        render("a\n<!-- table:t -->\nb\n", lambda name: "x", "doc.md")


def test_a_marker_naming_no_registered_table_fails_and_lists_the_registered_ones(tmp_path):
    (tmp_path / "doc.md").write_text("<!-- table:no-such-table -->\n<!-- /table -->\n")
    with pytest.raises(TableError, match="no-such-table.*registered: "):
        write(root=tmp_path, documents=("doc.md",))


def test_check_reports_a_stale_table_and_writes_nothing_while_write_fixes_it(tmp_path):
    doc = tmp_path / "doc.md"
    stale = "intro\n<!-- table:h100-kernel-sweep -->an old figure<!-- /table -->\n"
    doc.write_text(stale)
    diffs = write(root=tmp_path, documents=("doc.md",), check=True, only={"h100-kernel-sweep"})
    assert len(diffs) == 1 and "an old figure" in diffs[0] and doc.read_text() == stale
    write(root=tmp_path, documents=("doc.md",), only={"h100-kernel-sweep"})
    assert "bf16 GEMM shapes" in doc.read_text() and doc.read_text().startswith("intro\n")
    assert write(root=tmp_path, documents=("doc.md",), check=True, only={"h100-kernel-sweep"}) == []


def test_the_command_exits_1_on_a_stale_table_and_2_on_an_unknown_name(tmp_path, monkeypatch, capsys):
    assert tables.main(["--only", "no-such-table", "--check"]) == 2
    assert "no table no-such-table" in capsys.readouterr().err
    (tmp_path / "README.md").write_text("<!-- table:h100-kernel-sweep -->stale<!-- /table -->\n")
    monkeypatch.setattr(tables, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(tables, "DOCUMENTS", ("README.md",))
    assert tables.main(["--check", "--only", "h100-kernel-sweep"]) == 1
    assert tables.main(["--only", "h100-kernel-sweep"]) == 0
    assert tables.main(["--check", "--only", "h100-kernel-sweep"]) == 0
