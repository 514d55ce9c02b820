"""The package layout is the data flow: nothing imports upward, no import cycles, click only
under cli/, no module past ~400 lines without saying why. Read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamrl"
# bottom to top; modules at the top of the package (schema, config, ...) are the contracts, 0
ORDER = ("bus", "verifiers", "envs", "producer", "policy", "workers", "learner", "ops",
         "evaluation", "local", "benchmarks", "cli")  # fmt: skip
MAX_LINES = 400
WHY = "Kept whole:"  # a module over MAX_LINES says why in its docstring, after these words


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The streamrl modules ``name`` imports (at any depth of its code), and 'click'."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            if c == "click" or c.startswith("click."):
                found.add("click")
            elif c in MODULES and c != name:
                found.add(c)
                break
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _rank(name: str) -> int:
    parts = name.split(".")
    return ORDER.index(parts[1]) + 1 if len(parts) > 1 and parts[1] in ORDER else 0


def test_every_package_is_placed_in_the_order():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"configs"} <= {*ORDER, "models"}, packages - set(ORDER)


def test_nothing_imports_upward():
    upward = sorted(
        f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps - {"click"} if _rank(d) > _rank(m)
    )
    assert upward == []


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(GRAPH[m] - {"click"}):
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state and (cycle := visit(d, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            assert visit(m, []) is None


def test_click_only_under_cli():
    users = sorted(m for m, deps in GRAPH.items() if "click" in deps)
    assert users and all(m == "streamrl.cli" or m.startswith("streamrl.cli.") for m in users)


def test_long_modules_say_why():
    long = {
        m: n
        for m, p in MODULES.items()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
        and WHY not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    }
    assert long == {}
