"""The shape of the code in src/: files and functions short enough to read in one sitting, imports at the
top.

- every file is at most 400 lines and every function (methods and nested functions included, decorators
  not) at most 80;
- every import inside a function is one of the allowed exceptions: anything in ``src/asyncrl/cli.py``
  (``asyncrl --help`` stays torch-free), a package the core install does not bring (``OPTIONAL``: the
  GPU-only and extra-only packages), or an import marked ``# lazy: <why>``, on the import's first line or
  on the comment line just above it, saying which exception applies (e.g. ``# lazy: config stays
  torch-free``).

The checks parse the files (``ast``) and import nothing from asyncrl, so they take well under a second.
Every failure lists each offender as ``path:line`` with its length or import. ``make lint`` runs this file
as a script, which prints the same lists grouped by package: ``python tests/static/test_code_shape.py``.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# cli.py imports each command's module inside main(): `asyncrl --help` imports neither torch nor vLLM
LAZY_FILES = {"src/asyncrl/cli.py"}
# top-level packages the core install does not bring: GPU-only (the gpu extra, source builds) and the
# optional extras (hub, notebooks); importing them inside the function that needs them keeps every
# other path of the module working without them
OPTIONAL = {"vllm", "flash_attn", "flash_attn_interface", "uvloop", "datasets", "pandas", "matplotlib"}
MARKER = re.compile(r"#\s*lazy:\s*\S")


def python_files(src: Path) -> list[Path]:
    return sorted(src.rglob("*.py"))


def rel(path: Path, src: Path) -> str:
    """The path as the repository names it (``src/asyncrl/...``)."""
    return path.relative_to(src.parent).as_posix()


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def long_files(src: Path = SRC) -> list[str]:
    found = []
    for path in python_files(src):
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            found.append(f"{rel(path, src)}:1 {n} lines")
    return found


def long_functions(src: Path = SRC) -> list[str]:
    found = []
    for path in python_files(src):
        for fn in functions(ast.parse(path.read_text())):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{rel(path, src)}:{fn.lineno} {fn.name}() {n} lines")
    return found


def imported_top(node: ast.Import | ast.ImportFrom) -> str:
    """The top-level package an import names ("" for a relative import, which is never optional)."""
    if isinstance(node, ast.ImportFrom):
        return "" if node.level else (node.module or "").split(".")[0]
    return node.names[0].name.split(".")[0]


def function_level_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Imports anywhere inside a function body, nested functions included, each once."""
    inside: dict[int, ast.Import | ast.ImportFrom] = {}
    for fn in functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom):
                inside[id(node)] = node
    return sorted(inside.values(), key=lambda n: n.lineno)


def unmarked_imports(src: Path = SRC) -> list[str]:
    found = []
    for path in python_files(src):
        if rel(path, src) in LAZY_FILES:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in function_level_imports(ast.parse(source)):
            if imported_top(node) in OPTIONAL:
                continue
            line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if MARKER.search(line) or (above.startswith("#") and MARKER.search(above)):
                continue
            found.append(f"{rel(path, src)}:{node.lineno} {line.strip()}")
    return found


def by_package(found: list[str]) -> dict[str, list[str]]:
    """Offenders grouped by the package under src/ (``asyncrl/trainer``, ``asyncrl/cli.py``...), for
    owners."""
    groups: dict[str, list[str]] = defaultdict(list)
    for entry in found:
        parts = entry.split(":")[0].split("/")
        groups["/".join(parts[1:3])].append(entry)
    return dict(sorted(groups.items()))


def report(title: str, found: list[str]) -> str:
    lines = [f"{title}: {len(found)}"]
    for package, entries in by_package(found).items():
        lines.append(f"  {package} ({len(entries)})")
        lines.extend(f"    {e}" for e in entries)
    return "\n".join(lines)


def test_every_file_is_at_most_400_lines():
    found = long_files()
    assert not found, report(f"files over {MAX_FILE_LINES} lines", found)


def test_every_function_is_at_most_80_lines():
    found = long_functions()
    assert not found, report(f"functions over {MAX_FUNCTION_LINES} lines", found)


def test_function_level_imports_are_allowed_or_marked():
    found = unmarked_imports()
    assert not found, report("function-level imports neither allowed nor marked `# lazy: <why>`", found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check on deliberately bad files, so that none of them is a check that cannot fail."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    (src / "pkg" / "long.py").write_text("def f():\n" + body + "    return x\n" + "\n" * MAX_FILE_LINES)
    (src / "pkg" / "lazy.py").write_text(
        "def g():\n    import json\n    import vllm.config\n    # lazy: stays torch-free\n    import torch\n"
        "    from numpy import ndarray  # lazy: stays numpy-free\n    def h():\n        import os\n"
    )
    assert long_files(src) == [f"src/pkg/long.py:1 {MAX_FUNCTION_LINES + 2 + MAX_FILE_LINES} lines"]
    assert long_functions(src) == [f"src/pkg/long.py:1 f() {MAX_FUNCTION_LINES + 2} lines"]
    assert unmarked_imports(src) == ["src/pkg/lazy.py:2 import json", "src/pkg/lazy.py:8 import os"]


if __name__ == "__main__":
    results = [
        (f"files over {MAX_FILE_LINES} lines", long_files()),
        (f"functions over {MAX_FUNCTION_LINES} lines", long_functions()),
        ("function-level imports neither allowed nor marked `# lazy: <why>`", unmarked_imports()),
    ]
    for title, found in results:
        print(report(title, found))
    sys.exit(1 if any(found for _, found in results) else 0)
