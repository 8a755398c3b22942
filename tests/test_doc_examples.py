"""Every example output in README.md and docs/*.md is what dcsched prints today (tools/doc_examples.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import doc_examples  # noqa: E402

USED = doc_examples.used()


def test_every_marker_names_an_example_and_every_example_is_shown():
    assert set(USED) == set(doc_examples.EXAMPLES), (sorted(USED), sorted(doc_examples.EXAMPLES))


@pytest.mark.parametrize("name", sorted(doc_examples.EXAMPLES))
def test_example_is_current(name):
    expected = doc_examples.EXAMPLES[name]()
    for path in USED.get(name, []):
        for found, text in doc_examples.blocks(path):
            if found == name:
                assert text == expected, f"{path.name}: example {name} is stale: tools/doc_examples.py --write {name}"


def test_check_names_a_stale_block(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "page.md"
    doc.write_text("intro\n<!-- example: algorithms -->`none`<!-- /example -->\n", encoding="utf-8")
    monkeypatch.setattr(doc_examples, "DOC_FILES", [doc])
    monkeypatch.setattr(doc_examples, "ROOT", tmp_path)
    assert doc_examples.main(["--check"]) == 1
    assert "page.md: algorithms" in capsys.readouterr().err
    assert doc_examples.main(["--write"]) == 0
    assert doc_examples.main(["--check"]) == 0
    assert "`fsdp`" in doc.read_text(encoding="utf-8") and doc.read_text(encoding="utf-8").startswith("intro\n")


def test_scheduler_time_is_masked_and_no_colour_reaches_a_block():
    text = doc_examples.EXAMPLES["schedule-narrow"]()
    assert "varies" in text and "\x1b" not in text
    assert " ms │" in text  # the simulated figures stay


def test_readme_scheduler_table_has_one_short_linked_row_per_algorithm():
    from dcsched import schedulers
    readme = (doc_examples.ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Schedulers"):readme.index("## Python API")]
    rows = {line.split("`")[1]: line for line in table.splitlines() if line.startswith("| [`")}
    assert list(rows) == schedulers.available()
    for name, row in rows.items():
        assert "](docs/" in row and len(row) < 300, (name, len(row))


def _pages():
    return [doc_examples.ROOT / "README.md", *sorted((doc_examples.ROOT / "docs").glob("*.md"))]


def test_glossary_links_name_a_term_it_defines():
    import re
    glossary = (doc_examples.ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", line[4:].strip().lower()).replace(" ", "-")
               for line in glossary.splitlines() if line.startswith("### ")}
    for page in _pages():
        for anchor in re.findall(r"glossary\.md#([a-z0-9-]+)", page.read_text(encoding="utf-8")):
            assert anchor in anchors, f"{page.name}: glossary.md#{anchor} is not a term of the glossary"


def test_reference_pages_hold_no_history():
    import re
    history = re.compile(r"\(issue #?\d+|issue #\d+|\bissue \d+'s|\bissue \d+,? item|this commit|"
                         r"before this (change|commit|round|one)|first form of|the run before this|before this was",
                         re.IGNORECASE)
    for page in _pages():
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            assert not history.search(line), f"{page.name}:{number}: history belongs in CHANGELOG.md: {line.strip()}"


def _anchors(page):
    import re
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text(encoding="utf-8").splitlines() if re.match(r"#+ ", line)}


def test_links_between_pages_reach_a_file_and_a_heading():
    import re
    for page in [*_pages(), doc_examples.ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: link to {target}: no such file"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{page.name}: link to {target}: no such heading"
