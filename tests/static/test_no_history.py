"""The code and its docs describe the software as it is: no commit hashes and no work-item numbers.

History (which commit changed what, which work item asked for it) lives in commit messages and
``benchmarks/results/``. This is the search ``git grep -n -E '\\b[0-9a-f]{7,40}\\b|[Ii]ssue [0-9]+'`` over
``src/ tests/ README.md docs/``, done in Python over the files git tracks (plus new, not yet ignored ones),
with two refinements, both below: a run of decimal digits is a number, not a hash, and ``ALLOWED`` names the
few hex strings that are data, each with its reason. Test data that only looks like a hash is better built at
run time (``"b" * 7``) than allowed here. ``python tests/static/test_no_history.py`` prints what it finds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCOPE = ("src", "tests", "README.md", "docs")
PATTERN = re.compile(r"\b[0-9a-f]{7,40}\b|[Ii]ssue [0-9]+")
# (path, the string found) -> why it stays
ALLOWED = {
    # the upstream commit the vendored devcontainer schema was copied from: its provenance, needed to update
    # it (split here so that this file does not match the search itself)
    ("tests/static/schemas/README.md", "c95ff" + "eed1d"): "upstream commit of a vendored file",
}


def files(repo: Path) -> list[Path]:
    """The files in scope: tracked or new (git's ignore rules apply), else every file outside caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPE],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        paths = [repo / p for p in out]
    except (OSError, subprocess.CalledProcessError):  # no git, or not a clone (an unpacked archive)
        roots = [repo / s for s in SCOPE]
        paths = [p for r in roots for p in ([r] if r.is_file() else sorted(r.rglob("*"))) if p.is_file()]
        paths = [p for p in paths if "__pycache__" not in p.parts]
    return sorted(p for p in paths if p.is_file())


def history(repo: Path = REPO) -> list[str]:
    """Every hash-like string or work-item number, as ``path:line: match``."""
    found = []
    for path in files(repo):
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary test data (model weights, images)
            continue
        name = path.relative_to(repo).as_posix()
        for number, line in enumerate(text.splitlines(), 1):
            for match in PATTERN.finditer(line):
                token = match.group()
                # a run of decimal digits (1048576, 0.30000000000000004) is a number; a short hash of digits
                # only is rare enough that the search would rather miss it than flag every long number
                if token.isdigit() or (name, token) in ALLOWED:
                    continue
                found.append(f"{name}:{number}: {token}  | {line.strip()[:120]}")
    return found


def test_no_commit_hashes_or_work_item_numbers():
    found = history()
    assert not found, (
        "commit hashes or work-item numbers (say why in the present tense instead):\n" + "\n".join(found)
    )


def test_the_search_finds_what_it_looks_for(tmp_path):
    """The search on a deliberately bad tree, so that it is not a check that cannot fail. The strings are
    built at run time so that this file does not match itself."""
    (tmp_path / "src").mkdir()
    work_item, short_hash = "Issue " + str(16), "e8a" + "3883"
    (tmp_path / "src" / "bad.py").write_text(
        f"# ({work_item}) made it faster, before {short_hash}\nSIZE = 1048576\nDIGEST = '{'f' * 64}'\n"
    )
    (tmp_path / "README.md").write_text(f"see {work_item.lower()}\n")
    assert [entry.split("  |")[0] for entry in history(tmp_path)] == [
        f"README.md:1: {work_item.lower()}",
        f"src/bad.py:1: {work_item}",
        f"src/bad.py:1: {short_hash}",
    ]


if __name__ == "__main__":
    found = history()
    print("\n".join(found) or "none")
    sys.exit(1 if found else 0)
