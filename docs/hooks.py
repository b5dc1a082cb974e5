"""MkDocs hooks: fail the build on an incomplete API reference or on Markdown that rendered
wrong, generate the options table.

* ``on_pre_build`` runs :func:`docstring_problems` on ``docs/reference`` and logs a warning for
  each problem, so ``mkdocs build --strict`` fails on a missing or incomplete docstring.
* ``on_page_markdown`` replaces ``<!-- loco-train-options -->`` with a table of every
  ``loco train`` option, generated from :class:`loco.config.TrainConfig`, and opens every
  API reference page with a table of what it documents (:func:`summary_table`).
* ``on_page_content`` runs :func:`rendering_problems` on every page's HTML and logs a warning
  for each problem, so ``--strict`` fails on a list that merged into a paragraph or on maths
  that ``attr_list`` read as attributes.

Only the standard library is imported here (loco on use), so the tests can load this file
without mkdocs installed.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import inspect
import logging
import re
from html.parser import HTMLParser
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.loco")

DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
MARKER = "<!-- loco-train-options -->"


# ------------------------------------------------------------------------ docstring checker
def directives(reference_dir: str | Path) -> list[str]:
    """The dotted paths of every ``::: path`` directive in ``reference_dir/*.md``."""
    return [path for page in sorted(Path(reference_dir).glob("*.md"))
            for path in DIRECTIVE.findall(page.read_text(encoding="utf-8"))]


def resolve(path: str):
    """Import the object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module in {path}")


def args_section(doc: str | None) -> set[str]:
    """The names listed in a Google-style ``Args:`` section: ``name:``, ``name (type):``,
    ``*args:``, ``**kwargs:`` at the section's first indentation level."""
    lines = inspect.cleandoc(doc or "").splitlines()
    names: set[str] = set()
    for i, line in enumerate(lines):
        if line.strip() not in ("Args:", "Arguments:"):
            continue
        header, entry = len(line) - len(line.lstrip()), None
        for body in lines[i + 1:]:
            indent = len(body) - len(body.lstrip())
            if body.strip() and indent <= header:
                break  # the section ends where the text comes back to its header's level
            if body.strip() and (entry is None or indent == entry):
                entry = indent
                match = re.match(r"\s*(\*{0,2}\w+)\s*(\([^)]*\))?:", body)
                if match:
                    names.add(match.group(1))
    return names


def parameters(func, skip_first: bool) -> list[str]:
    """Parameter names of ``func`` as written in ``Args:`` (``*args``, ``**kwargs``)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return []
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + p.name for p in params[1 if skip_first else 0:]]


def _in_package(obj, package: str) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == package


def _check_args(where: str, doc: str | None, params: list[str], documented=()) -> list[str]:
    listed = args_section(doc)
    return ([f"{where}: parameter {p} is not in Args" for p in params
             if p not in listed and p not in documented]
            + [f"{where}: Args lists {name}, which is not a parameter"
               for name in sorted(listed - set(params))])


def _check_function(where: str, func, is_method: bool = False) -> list[str]:
    if not (func.__doc__ or "").strip():
        return [f"{where}: no docstring"]
    return _check_args(where, func.__doc__, parameters(func, skip_first=is_method))


def _check_class(where: str, cls: type) -> list[str]:
    """The class, its ``__init__`` arguments and every public method or property it defines
    or inherits from a class of its own package (loco's, not torch's or the builtins')."""
    package = where.split(".")[0]
    problems = [] if (cls.__doc__ or "").strip() else [f"{where}: no docstring"]
    owner = next(k for k in cls.__mro__ if "__init__" in vars(k))
    if _in_package(owner, package):  # merge_init_into_class: Args of the class
        doc = (cls.__doc__ or "") + "\n\n" + (vars(owner)["__init__"].__doc__ or "")
        # A dataclass field with a help text is documented by it (the options table).
        helped = {f.name for f in dataclasses.fields(cls) if f.metadata.get("help")} \
            if dataclasses.is_dataclass(cls) else set()
        problems += _check_args(where, doc, parameters(cls.__init__, skip_first=True), helped)
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not _in_package(owner, package):
            continue  # inherited from torch, the standard library, ...
        member, qualified = vars(owner)[name], f"{owner.__module__}.{owner.__qualname__}.{name}"
        if isinstance(member, property):
            if not (member.__doc__ or "").strip():
                problems.append(f"{qualified}: no docstring")
        elif isinstance(member, (staticmethod, classmethod)):
            problems += _check_function(qualified, _with_base_args(cls, name, member.__func__),
                                        is_method=isinstance(member, classmethod))
        elif inspect.isfunction(member):
            problems += _check_function(qualified, _with_base_args(cls, name, member),
                                        is_method=True)
    return problems


def _with_base_args(cls: type, name: str, func):
    """``func``, or where its docstring has no ``Args:`` section and it overrides a method
    whose docstring has one (a method's seam, ``loco.algorithms.method.Method``), a stand-in
    whose docstring adds that section: an override inherits its base's arguments."""
    doc = func.__doc__ or ""
    if not doc.strip() or "Args:" in doc or not parameters(func, skip_first=True):
        return func
    for base in cls.__mro__:
        found = vars(base).get(name)
        found = getattr(found, "__func__", found)
        if found is not None and found is not func and "Args:" in (found.__doc__ or ""):
            base_doc = found.__doc__
            args = base_doc[base_doc.rindex("\n", 0, base_doc.index("Args:")) + 1:]

            def stand_in(*a, **k):
                return func(*a, **k)
            stand_in.__doc__ = doc + "\n\n" + args
            stand_in.__signature__ = inspect.signature(func)
            return stand_in
    return func


def docstring_problems(reference_dir: str | Path) -> list[str]:
    """Every gap in the docstrings of the objects the reference pages document, one string
    each: a missing docstring (on the object, or on a public method or property it defines or
    inherits from a class of its package), a parameter that ``Args:`` does not list (for a
    class: of its ``__init__``, documented in the class docstring), an ``Args:`` entry that is
    not a parameter, a directive that does not import. Module-level constants need only exist;
    a dataclass field with a ``metadata["help"]`` text (TrainConfig's) is documented by it.

    Args:
        reference_dir: folder of the reference pages (``docs/reference``); every
            ``::: dotted.path`` line of its ``*.md`` files is checked.

    Returns:
        The problems, in page order, without duplicates; empty when the reference is
        complete.
    """
    problems: list[str] = []
    for path in directives(reference_dir):
        try:
            obj = resolve(path)
        except (ImportError, AttributeError) as err:
            problems.append(f"{path}: cannot import ({err})")
            continue
        if inspect.ismodule(obj):
            found = [] if (obj.__doc__ or "").strip() else [f"{path}: no docstring"]
        elif inspect.isclass(obj):
            found = _check_class(path, obj)
        elif callable(obj):
            found = _check_function(path, obj)
        else:
            found = []  # a constant: it exists
        problems += [p for p in found if p not in problems]
    return problems


# ------------------------------------------------------------------------- options table
def _cell(text: str) -> str:
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def options_table() -> str:
    """A Markdown table of every ``loco train`` option (flag, YAML key, default, choices,
    help), from :class:`loco.config.TrainConfig` as ``loco.cli.add_train_options`` reads it."""
    from loco.config import TrainConfig
    from loco.config import choices as config_choices
    from loco.config.groups import section_of

    where = section_of()
    rows = ["| Flag | YAML key | Default | Choices | Help |", "|---|---|---|---|---|"]
    for f in TrainConfig.fields():
        name = f.name.replace("_", "-")
        flag = f"--[no-]{name}" if str(f.type).startswith("bool") else f"--{name}"
        default = "—" if f.default is None else f"`{f.default}`"
        choices = ", ".join(f"`{c}`" for c in config_choices(f) or ()) or "—"
        rows.append(f"| `{flag}` | `{where[f.name]}: {f.name}` | {default} | {choices} | "
                    f"{_cell(f.metadata['help'])} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------ rendering checker
LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


class _RenderingChecker(HTMLParser):
    """Collects the text of every ``<p>`` outside ``<code>`` and every ``<em>`` that has
    attributes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.attributed: list[str] = []
        self._text: list[str] | None = None  # the open paragraph's text
        self._code = 0

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._text = []
        elif tag == "code":
            self._code += 1
        elif tag == "em" and attrs:
            self.attributed.append(" ".join(f'{k}="{v}"' for k, v in attrs))

    def handle_endtag(self, tag):
        if tag == "p" and self._text is not None:
            self.paragraphs.append("".join(self._text))
            self._text = None
        elif tag == "code":
            self._code = max(0, self._code - 1)

    def handle_data(self, data):
        if self._text is not None:
            self._text.append("\u2026" if self._code else data)


def rendering_problems(page_html: str) -> list[str]:
    """What Python-Markdown got wrong in a rendered page, one string each.

    * A paragraph with a line that starts with a list marker (``- ``, ``* ``, ``+ ``,
      ``1. ``): a list that merged into the paragraph before it, because no blank line
      separates them (or a nested block lacks its 4-space indentation).
    * An ``<em>`` with attributes: ``attr_list`` read text such as ``_{m,p}`` as
      ``{attributes}`` (write maths as ``$...$``).

    Args:
        page_html: the HTML of one page's content, as ``on_page_content`` receives it.

    Returns:
        The problems, in page order; empty when the page rendered as written.
    """
    checker = _RenderingChecker()
    checker.feed(page_html)
    checker.close()
    problems = []
    for text in checker.paragraphs:
        lines = text.splitlines()
        for line in lines[1:]:  # the first line cannot have merged into anything
            if LIST_MARKER.match(line):
                problems.append(f"a list merged into a paragraph (add a blank line before "
                                f"it): {line.strip()[:70]!r}")
    problems += [f"<em {attrs}>: text read as attributes (write maths as $...$)"
                 for attrs in checker.attributed]
    return problems


# ----------------------------------------------------------------------- reference summary
def _first_sentence(doc: str, limit: int = 160) -> str:
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    paragraph = re.sub(r":\w+:`", "`", paragraph)  # Sphinx roles such as :func:`name`
    match = re.match(r"(.{20,}?)[.:;](\s|$)", paragraph)
    text = match.group(1) + "." if match else paragraph
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def summary_table(markdown: str) -> str:
    """A Markdown table of the objects a reference page documents, in page order: each
    ``::: dotted.path`` as a link to its entry and the first sentence of its docstring
    (constants: their type).

    Args:
        markdown: the page's Markdown, with its ``::: dotted.path`` directives.

    Returns:
        The table, or ``""`` when the page has no directive.
    """
    paths = DIRECTIVE.findall(markdown)
    if not paths:
        return ""
    rows = ["| name | what it is |", "|---|---|"]
    for path in paths:
        obj = resolve(path)
        if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
            what = _cell(_first_sentence(obj.__doc__ or "")) or "—"
        else:
            what = f"constant ({type(obj).__name__})"
        rows.append(f"| [`{path.rsplit('.', 1)[-1]}`][{path}] | {what} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------- hooks
def on_pre_build(config) -> None:
    for problem in docstring_problems(Path(config["docs_dir"]) / "reference"):
        log.warning("API reference: %s", problem)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, options_table())
    source = getattr(getattr(page, "file", None), "src_uri", "")
    if source.startswith("reference/") and "\n## " in markdown:
        head, rest = markdown.split("\n## ", 1)  # the table goes before the first section
        markdown = f"{head}\n{summary_table(markdown)}\n\n## {rest}"
    return markdown


def on_page_content(html_text: str, page, config, files) -> str:
    for problem in rendering_problems(html_text):
        log.warning("%s: %s", page.file.src_uri, problem)
    return html_text
