"""The house's shape: the commands are thin entry modules, and no import circle exists among
`engine/` and `trainer/` modules when imports inside functions are counted (one that closes
a circle only hides it). Read with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("engine", "trainer")
COMMANDS = ("train", "evaluate", "plan", "report", "certify", "compare", "preview", "lighthouse")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports anywhere in its body (but under
    `if TYPE_CHECKING:`, which never runs)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}

    def owner(name: str) -> str | None:  # `engine.x.Name` -> the module `engine.x`
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found.update(t for t in map(owner, targets) if t and t != name)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), but a package whose
    `__init__` imports its own submodules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            root = min(comp, key=len)
            if len(comp) > 1 and not all(c == root or c.startswith(root + ".") for c in comp):
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "trainer.run.fit" in graph and "engine.steps.accumulate" in graph  # it read them
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    """The check itself: a late import closing a loop is a circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_engine_imports_nothing_of_trainer() -> None:
    graph = import_graph()
    leaks = {m: sorted(t for t in ts if t.startswith("trainer")) for m, ts in graph.items()}
    assert {m: t for m, t in leaks.items() if m.startswith("engine") and t} == {}


def test_commands_are_thin_entry_modules() -> None:
    """`python -m trainer.<command>` modules parse, call into a concern's folder and print:
    nothing else imports them, and they stay short."""
    graph = import_graph()
    for command in COMMANDS:
        module = f"trainer.{command}"
        importers = sorted(m for m, ts in graph.items() if module in ts)
        assert importers == [], (module, importers)
        body = (REPO / "trainer" / f"{command}.py").read_text()
        code = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        assert len(code) - len(ast.get_docstring(ast.parse(body)).splitlines()) < 90, command
    top = sorted(p.name for p in (REPO / "trainer").iterdir() if p.suffix == ".py")
    package = ["__init__.py", "api.py", "version.py"]  # the package, its API and its version
    assert top == sorted([*package, *(f"{c}.py" for c in COMMANDS)]), top


# Calls to the builtins getattr/hasattr in engine/ and trainer/ (61 before the chat and cached
# wave, 91 after it): an attribute looked up by name is duck typing where a Protocol, a typed
# attribute or isinstance would name the concept. What is left reads foreign objects
# (transformers configs, torch internals) or walks names a user gave.
MAX_GETATTR = 61


def getattr_lines(source: str) -> list[int]:
    """The lines of the calls to the builtin getattr or hasattr in `source`."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
    ]


def test_getattr_and_hasattr_stay_few() -> None:
    calls = [
        f"{path.relative_to(REPO)}:{line}"
        for pkg in PACKAGES
        for path in sorted((REPO / pkg).rglob("*.py"))
        for line in getattr_lines(path.read_text())
    ]
    assert any(c.startswith("engine/") for c in calls), "it read engine/"
    assert len(calls) <= MAX_GETATTR, "\n".join(calls)


def test_getattr_calls_are_found() -> None:
    """The count itself: a call counts, a name in a comment or string does not."""
    source = 'x = getattr(a, "b")\nif hasattr(a, "c"):  # getattr(\n    y = "hasattr("\n'
    assert getattr_lines(source) == [1, 2]
