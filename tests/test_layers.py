"""The house rules, from the source alone (nothing imported): imports only go down the layers
(lazy imports inside functions count), no module over 800 lines, no function over a screen,
and the method's name is asked for only inside ``loco.algorithms``."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "loco"

#: The layers, bottom first; a module may import its own layer's and the ones below.
LAYERS = [
    ("options", "lazy", "comm", "model", "hf", "data", "simulate", "profiling", "plot"),
    ("algorithms", "runtime"),
    ("config", "dashboard", "checkpoint"),  # checkpoint: resume reads a saved TrainConfig
    ("training",),
    ("compare", "report", "harness", "plan"),
    ("cli", "__main__"),
]
MAX_LINES = 800
MAX_FUNCTION = 60  # lines of a function's body after its docstring: about one screen
NAME_TEST = re.compile(r"algorithm *(==|!=|in) *[(\[\"']|\.algorithm *(==|!=|in) ")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "loco" and not name.startswith(t + "."):
                out.add(t)
    return out


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "loco" and layer(m) is None] == []


def test_imports_only_go_down():
    known = modules()
    up = [f"{m} -> {t}" for m, path in known.items() if m != "loco"
          for t in imports(m, path, known) if layer(t) > layer(m)]
    assert up == []


def test_no_import_circles():
    known = modules()
    edges = {m: imports(m, p, known) for m, p in known.items()}
    state, circles = {}, []

    def visit(m, trail):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(trail[trail.index(t):] + [t]))
            elif t not in state:
                visit(t, trail + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_no_module_over_800_lines():
    long = {str(p.relative_to(SRC)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_function_over_a_screen():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            start = node.lineno
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                start = body[0].end_lineno
            if node.end_lineno - start > MAX_FUNCTION:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert long == []


def test_the_method_is_asked_for_by_name_only_inside_algorithms():
    hits = [f"{p.relative_to(SRC)}:{i}" for p in modules().values()
            if "algorithms" not in p.relative_to(SRC).parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if NAME_TEST.search(line)]
    assert len(hits) <= 3, hits
