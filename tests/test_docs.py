"""The documentation: a complete API reference, a generated options table, a nav that holds
every page. Runs without mkdocs: docs/hooks.py imports only the standard library (and loco)."""

import importlib.util
import textwrap
from pathlib import Path

import pytest
import yaml

import loco
from loco.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("loco_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_docstrings_are_complete(hooks):
    assert hooks.docstring_problems(REFERENCE) == []


def test_checker_reports_gaps(hooks, tmp_path, monkeypatch):
    (tmp_path / "throwaway_api.py").write_text(textwrap.dedent('''
        def bare(x):
            return x

        def partial(a, b, *rest, **options):
            """Documents some of its arguments.

            Args:
                a: documented.
                *rest: documented.
                ghost: not a parameter.
            """

        def complete(a, **kw):
            """Everything documented.

            Args:
                a (int): first.
                    A continuation line: not an entry.
                **kw: the rest.
            """

        class Thing:
            """A class whose constructor and one method lack documentation."""

            def __init__(self, size):
                self.size = size

            def grow(self):
                return self.size + 1

            def _private(self):
                pass

        LIMIT = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    pages = tmp_path / "reference"
    pages.mkdir()
    (pages / "api.md").write_text("# API\n\n" + "\n\n".join(
        f"::: throwaway_api.{name}" for name in
        ("bare", "partial", "complete", "Thing", "LIMIT", "missing")) + "\n")
    problems = hooks.docstring_problems(pages)
    assert "throwaway_api.bare: no docstring" in problems
    assert "throwaway_api.partial: parameter b is not in Args" in problems
    assert "throwaway_api.partial: parameter **options is not in Args" in problems
    assert "throwaway_api.partial: Args lists ghost, which is not a parameter" in problems
    assert "throwaway_api.Thing: parameter size is not in Args" in problems
    assert "throwaway_api.Thing.grow: no docstring" in problems
    assert any(p.startswith("throwaway_api.missing: cannot import") for p in problems)
    assert not [p for p in problems if "complete" in p or "LIMIT" in p or "_private" in p]
    assert len(problems) == 7, problems


def test_every_public_name_is_in_the_reference(hooks):
    documented = {id(hooks.resolve(path)) for path in hooks.directives(REFERENCE)}
    missing = [name for name in loco.__all__
               if name != "__version__" and id(getattr(loco, name)) not in documented]
    assert missing == []


def test_options_table_has_every_field(hooks):
    table = hooks.options_table()
    rows = table.splitlines()[2:]
    fields = TrainConfig.fields()
    assert len(rows) == len(fields)
    for field, row in zip(fields, rows):
        assert f": {field.name}` |" in row  # the YAML key under its section
        assert row.count("|") - row.count("\\|") == 6, row  # five cells, escaped | inside
    assert "`--[no-]progress`" in table and "`--sync-every`" in table
    assert "| `method: sync_every` |" in table and "| `optim: lr` |" in table
    page = (REFERENCE / "config.md").read_text()
    assert hooks.MARKER in page
    assert hooks.MARKER not in hooks.on_page_markdown(page, None, None, None)


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [p for item in entry for p in _nav_pages(item)]
    return [p for value in entry.values() for p in _nav_pages(value)]


def test_nav_holds_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), "a page is in the nav twice"
    assert [p for p in pages if p not in nav] == [], "pages missing from the nav"
    assert [p for p in nav if not (DOCS / p).is_file()] == [], "nav entries without a page"


def test_readme_is_short_and_its_links_resolve():
    """The README stays a front page (what, why, two commands, the API, links); every file it
    links or shows exists, so a page moved in docs/ cannot leave it pointing nowhere."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local and all((ROOT / t).exists() for t in local), \
        [t for t in local if not (ROOT / t).exists()]
    assert "make demo" in text and "make test" in text


def test_rendering_check_catches_merged_lists_and_attribute_maths(hooks):
    """The build fails on a list that Python-Markdown merged into the paragraph before it (no
    blank line) and on maths that attr_list read as attributes; a well-formed page passes."""
    bad = ("<p>The causes:\n- <strong>one</strong> cause\n* another\n12. a third</p>\n"
           "<p>merged as <em m_p=\"None\">θ</em> and more</p>")
    problems = hooks.rendering_problems(bad)
    assert len(problems) == 4, problems
    assert sum("list merged into a paragraph" in p for p in problems) == 3
    assert any(p.startswith('<em m_p="None">') for p in problems)
    good = ("<p>A paragraph - with a dash,\nthen 3 - 1 and 1.5 lines</p>\n<ul>\n<li>an item</li>\n"
            "</ul>\n<p>code: <code>x\n- y</code> and <em>emphasis</em></p>\n"
            "<pre><code>- not a paragraph\n</code></pre>")
    assert hooks.rendering_problems(good) == []


def test_rendering_check_runs_in_the_build(hooks, caplog):
    class Page:  # what on_page_content reads of mkdocs' page
        class file:
            src_uri = "bad.md"
    with caplog.at_level("WARNING", logger="mkdocs.plugins.loco"):
        assert hooks.on_page_content("<p>a\n- b</p>", Page, None, None) == "<p>a\n- b</p>"
    assert "bad.md: a list merged into a paragraph" in caplog.text


def _own_loop_example():
    spec = importlib.util.spec_from_file_location("own_loop_example",
                                                  DOCS / "examples" / "own_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_loop_example_runs_and_learns(capsys):
    """docs/examples/own_loop.py, which the own-loop page includes, runs as written: four
    thread workers of Streaming DiLoCo (FP4) learn the counting sequences."""
    import math

    example = _own_loop_example()
    loss = example.main(steps=40)
    assert loss < math.log(example.VOCAB) / 4
    assert "eval loss of the global model" in capsys.readouterr().out


def test_readme_loop_is_the_example_file():
    """The README's loop is the example's worker, line for line, and the own-loop page
    includes the file itself."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = (DOCS / "examples" / "own_loop.py").read_text(encoding="utf-8")
    start = readme.index("def worker(ctx")
    end = readme.index("\n", readme.index("return algo.global_parameters()", start))
    assert readme[start:end] in example
    assert '--8<-- "docs/examples/own_loop.py"' in (DOCS / "own-loop.md").read_text()


def test_reference_pages_open_with_a_summary_table(hooks):
    page = (REFERENCE / "runtime.md").read_text(encoding="utf-8")
    table = hooks.summary_table(page).splitlines()
    assert len(table) - 2 == len(hooks.DIRECTIVE.findall(page))
    assert all(row.startswith("| [`") and "][loco." in row for row in table[2:])

    class Page:
        class file:
            src_uri = "reference/runtime.md"
    out = hooks.on_page_markdown(page, Page, None, None)
    assert out.index(table[0]) < out.index("\n## ")
    assert hooks.summary_table("# no directives\n") == ""
