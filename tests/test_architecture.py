"""The layout is the architecture: parts import only downwards, nothing imports in a cycle, no test switches.

Parts of ``job`` in dependency order (a module may import its own part and the parts below it):
cli → lifecycle → proof → export → train → format, tasks, data → errors (and the package root). ``format`` (what a
generation holds), ``tasks`` (what is trained) and ``data`` (datasets in the bucket) are side by side: none imports
another. ``storage`` never imports ``job``;
``job`` never imports an S3 library; nothing in the product imports ``tests`` or reads a ``TRAINPROOF_TEST_``
variable. These are static checks over every import statement, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PART_RANK = {"__main__": 7, "cli": 6, "lifecycle": 5, "proof": 4, "export": 3, "train": 2, "format": 1, "tasks": 1,
             "data": 1, "errors": 0, "": 0}
REMOTE_LIBS = ("s3fs", "botocore", "boto3", "aiobotocore")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in ("job", "storage") for p in sorted((ROOT / pkg).rglob("*.py"))}


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


def test_every_part_of_job_exists_with_a_docstring_saying_what_it_owns():
    for part in ("cli", "lifecycle", "proof", "export", "train", "format", "tasks", "data"):
        doc = ast.get_docstring(ast.parse((ROOT / "job" / part / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"job/{part}/__init__.py needs a docstring saying what it owns"
    assert not [p.name for p in (ROOT / "job").glob("*.py") if p.name not in ("__init__.py", "__main__.py",
                                                                                 "errors.py")]


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("job")])
def test_job_imports_only_downwards(name):
    rank = PART_RANK[_part(name)]
    for imported in GRAPH[name]:
        if imported == "job" or not imported.startswith("job."):
            continue
        same_part = _part(imported) == _part(name)
        assert same_part or PART_RANK[_part(imported)] < rank, f"{name} (part {_part(name)!r}) imports {imported}"


def test_storage_never_imports_job_and_job_never_imports_s3_libraries():
    for name, imported in GRAPH.items():
        tops = {m.split(".")[0] for m in imported}
        if name.startswith("storage"):
            assert "job" not in tops, name
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
    assert "job.train.launch" in GRAPH["job.proof.paths"]
    assert PART_RANK[_part("job.cli.train")] > PART_RANK[_part("job.train.loop")]
    assert PART_RANK[_part("job.format.state")] == PART_RANK[_part("job.tasks.base")], "siblings: neither may import the other"
    with pytest.raises(AssertionError, match="import cycle"):
        saved = dict(GRAPH)
        try:
            GRAPH["job.errors"] = GRAPH["job.errors"] | {"job.train.loop"}
            test_no_import_cycles()
        finally:
            GRAPH.clear()
            GRAPH.update(saved)
