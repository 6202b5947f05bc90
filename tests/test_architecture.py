"""The layout is the architecture: parts import only downwards, nothing imports in a cycle, no test switches.

One importable package, ``trainproof``; its parts in dependency order (a module may import its own part and the parts
below it): cli → lifecycle → proof → export → train → format, tasks, data → errors (and the package root) → storage.
``format`` (what a generation holds), ``tasks`` (what is trained) and ``data`` (datasets in the bucket) are side by
side: none imports another. ``trainproof.storage`` imports no other part of ``trainproof``; nothing outside
``trainproof.storage`` imports an S3 library; nothing in the product imports ``tests`` or reads a ``TRAINPROOF_TEST_``
variable. These are static checks over every import statement, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "trainproof"
PART_RANK = {"__main__": 8, "cli": 7, "lifecycle": 6, "proof": 5, "export": 4, "train": 3, "format": 2, "tasks": 2,
             "data": 2, "errors": 1, "": 1, "storage": 0}
REMOTE_LIBS = ("s3fs", "botocore", "boto3", "aiobotocore")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (absolute names; ``from pkg import sub`` resolved to ``pkg.sub``)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


GRAPH = {name: {m for m in _imports(name, path)} for name, path in MODULES.items()}


def _part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def test_every_part_exists_with_a_docstring_saying_what_it_owns():
    for part in ("cli", "lifecycle", "proof", "export", "train", "format", "tasks", "data", "storage"):
        doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / part / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"trainproof/{part}/__init__.py needs a docstring saying what it owns"
    assert not [p.name for p in (ROOT / PACKAGE).glob("*.py") if p.name not in ("__init__.py", "__main__.py",
                                                                                  "errors.py")]


def test_one_top_level_package_is_installed():
    """Only ``trainproof`` is packaged: a user's own ``storage/`` or ``job/`` package is never shadowed."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["trainproof", "trainproof.*"]' in text
    assert not [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                and p.name not in (PACKAGE, "tests", "examples", "bench")]


@pytest.mark.parametrize("name", list(MODULES))
def test_parts_import_only_downwards(name):
    rank = PART_RANK[_part(name)]
    for imported in GRAPH[name]:
        if imported == PACKAGE or not imported.startswith(PACKAGE + "."):
            continue
        same_part = _part(imported) == _part(name)
        assert same_part or PART_RANK[_part(imported)] < rank, f"{name} (part {_part(name)!r}) imports {imported}"


def test_storage_imports_no_other_part_and_only_storage_imports_s3_libraries():
    for name, imported in GRAPH.items():
        tops = {m.split(".")[0] for m in imported}
        if _part(name) == "storage":
            assert not {m for m in imported if m.startswith(PACKAGE + ".") and _part(m) != "storage"}, name
        else:
            assert not tops & set(REMOTE_LIBS), f"{name} imports {tops & set(REMOTE_LIBS)}"
        assert "tests" not in tops, f"{name} imports from tests/"


def test_no_import_cycles():
    internal = {n: {m for m in deps if m in MODULES and m != n and not n.startswith(m + ".")}
                for n, deps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(internal[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(internal):
        if n not in state:
            visit(n)


def test_no_test_switch_in_the_product():
    for name, path in MODULES.items():
        assert "TRAINPROOF_TEST_" not in path.read_text(), f"{path} reads a test-only switch"


def test_the_checks_above_can_fail():
    """The checker itself: a planted upward import and a planted cycle are found."""
    assert "trainproof.train.launch" in GRAPH["trainproof.proof.paths"]
    assert PART_RANK[_part("trainproof.cli.train")] > PART_RANK[_part("trainproof.train.loop")]
    assert PART_RANK[_part("trainproof.format.state")] == PART_RANK[_part("trainproof.tasks.base")], "siblings: neither may import the other"
    with pytest.raises(AssertionError, match="import cycle"):
        saved = dict(GRAPH)
        try:
            GRAPH["trainproof.errors"] = GRAPH["trainproof.errors"] | {"trainproof.train.loop"}
            test_no_import_cycles()
        finally:
            GRAPH.clear()
            GRAPH.update(saved)
