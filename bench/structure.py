"""The product's shape in figures, for restructuring notes: lines, modules over 400 lines, the longest functions,
the size of the central classes, the complexity rule's count and the README's length.

    .venv/bin/python bench/structure.py [--root DIR] [--json]

``--root`` measures another checkout (e.g. ``git worktree add /tmp/before <commit>``), so before and after come from
the same script. Lines are physical lines of ``*.py`` under the package folders.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

CLASSES = ("Protocol", "Trainer", "Checkpointer")


def packages(root: Path) -> list[Path]:
    found = [root / "trainproof"] if (root / "trainproof").is_dir() else [root / "job", root / "storage"]
    return [p for p in found if p.is_dir()]


def measure(root: Path) -> dict:
    files = sorted(f for pkg in packages(root) for f in pkg.rglob("*.py") if "__pycache__" not in f.parts)
    lines = {str(f.relative_to(root)): len(f.read_text().splitlines()) for f in files}
    functions: list[tuple[int, str]] = []
    classes: dict[str, dict] = {}
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{f.relative_to(root)}:{node.name}"))
            if isinstance(node, ast.ClassDef) and node.name in CLASSES:
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                classes[node.name] = {"file": str(f.relative_to(root)), "lines": node.end_lineno - node.lineno + 1,
                                      "methods": len(methods)}
    functions.sort(reverse=True)
    ruff = Path(sys.executable).parent / "ruff"
    c901 = subprocess.run([str(ruff), "check", "--no-cache", "--select", "C901", "--output-format", "concise",
                           *map(str, packages(root))], capture_output=True, text=True)
    readme = root / "README.md"
    return {
        "product_lines": sum(lines.values()),
        "modules": len(lines),
        "modules_over_400": sorted((n, f) for f, n in lines.items() if n > 400)[::-1],
        "longest_functions": functions[:8],
        "classes": classes,
        "complexity_over_10": sum(1 for line in c901.stdout.splitlines() if " C901 " in line),
        "readme_lines": len(readme.read_text().splitlines()) if readme.exists() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.root)
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    for key, value in figures.items():
        if isinstance(value, list):
            print(f"{key}:")
            for row in value:
                print(f"  {row[0]:>5}  {row[1]}")
        elif isinstance(value, dict):
            print(f"{key}:")
            for name, row in value.items():
                print(f"  {name}: {row}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
