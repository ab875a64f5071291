"""Code rewards: the program in a reply, and code datasets' tests as sandbox tests (pure functions).

Dataset tests written as ``assert f(args) == value`` (MBPP, HumanEval) become ``call`` tests by reading them
with :mod:`ast`, not by running them: the arguments and the expected value must be literals, and the verdict
is then taken outside the sandbox (:func:`asyncrl.sandbox.matches`). Running the dataset's asserts next to
the program instead would let the program decide its own verdict (``__eq__`` that always holds, a patched
``AssertionError``, ``os._exit(0)``). Asserts that are not of that form are skipped and counted.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(reply: str) -> str:
    """The program in a model's reply: its last fenced block labelled python (``py``, ``python3``), else its
    last fenced block of any label, else the whole reply if it has no fence. A block cut off by the token
    limit counts up to the end of the reply."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(reply)]
    if not blocks:
        return reply if "```" not in reply else ""
    python = [code for label, code in blocks if label in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    try:
        # what the sandbox can send back: tuples become lists, sets and bytes are not comparable
        json.dumps(value)
    except (TypeError, ValueError):
        return False, None
    return True, value


def _call_test(node: ast.Assert, names: set[str], entry_point: str) -> dict[str, Any] | None:
    cmp = node.test
    if not (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq)):
        return None
    for call, other in ((cmp.left, cmp.comparators[0]), (cmp.comparators[0], cmp.left)):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names:
            if any(isinstance(a, ast.Starred) for a in call.args) or any(
                k.arg is None for k in call.keywords
            ):
                return None
            parts = (
                [_literal(a) for a in call.args]
                + [_literal(k.value) for k in call.keywords]
                + [_literal(other)]
            )
            if not all(ok for ok, _ in parts):
                return None
            values = [v for _, v in parts]
            n = len(call.args)
            return {
                "kind": "call",
                "fn": entry_point or call.func.id,
                "args": values[:n],
                "kwargs": {k.arg: v for k, v in zip(call.keywords, values[n:-1], strict=True)},
                "expected": values[-1],
            }
    return None


def call_tests_from_asserts(
    source: str, entry_point: str = "", alias: str = "candidate"
) -> tuple[list[dict], int]:
    """The ``assert f(...) == literal`` statements of ``source`` as call tests, and how many asserts were
    skipped (not of that form). ``f`` is ``entry_point`` or its ``alias`` (HumanEval's ``candidate``);
    without an entry point, any function name (MBPP), and the test calls that name."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [], 1
    tests, skipped = [], 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        if entry_point:
            names = {entry_point, alias}
        elif isinstance(node.test, ast.Compare):
            names = {
                n.func.id
                for n in (node.test.left, *node.test.comparators)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            }
        else:
            names = set()
        test = _call_test(node, names, entry_point)
        if test is None:
            skipped += 1
        else:
            tests.append(test)
    return tests, skipped


def from_mbpp(row: dict[str, Any], shown: int) -> tuple[dict[str, Any] | None, int]:
    """An MBPP row (``text`` or ``prompt``, ``code``, ``test_list``, ``test_setup_code``) as a problem: the
    first ``shown`` asserts in the question, every convertible assert as a test."""
    asserts = list(row["test_list"]) + list(row.get("challenge_test_list") or [])
    tests, skipped = call_tests_from_asserts("\n".join(asserts))
    if not tests:
        return None, skipped
    text = row.get("text") or row.get("prompt") or ""
    question = f"{text} The function must be named `{tests[0]['fn']}`."
    if shown:
        question += " Your code should pass these tests:\n" + "\n".join(row["test_list"][:shown])
    return {
        "question": question,
        "solution": row["code"],
        "tests": tests,
        "setup": row.get("test_setup_code") or "",
    }, skipped


def from_humaneval(row: dict[str, Any], shown: int) -> tuple[dict[str, Any] | None, int]:
    """A HumanEval row (``prompt``, ``canonical_solution``, ``test`` with ``check(candidate)``,
    ``entry_point``)."""
    tests, skipped = call_tests_from_asserts(row["test"], row["entry_point"])
    if not tests:
        return None, skipped
    question = (
        f"Complete the Python function below (write the whole function):\n```python\n{row['prompt']}```"
    )
    return {
        "question": question,
        "solution": row["prompt"] + row["canonical_solution"],
        "tests": tests,
    }, skipped


def from_apps(row: dict[str, Any], shown: int) -> tuple[dict[str, Any] | None, int]:
    """An APPS-style row (``question``, ``solutions`` and ``input_output`` as JSON strings): standard-input
    problems only; call-based rows (``fn_name``) are skipped."""
    io = json.loads(row["input_output"]) if isinstance(row["input_output"], str) else row["input_output"]
    if not io or io.get("fn_name") or not io.get("inputs"):
        return None, 1
    tests = [
        {
            "kind": "io",
            "stdin": i if isinstance(i, str) else "\n".join(map(str, i)),
            "expected": o if isinstance(o, str) else "\n".join(map(str, o)),
        }
        for i, o in zip(io["inputs"], io["outputs"], strict=True)
    ]
    solutions = (
        json.loads(row["solutions"])
        if isinstance(row.get("solutions"), str) and row["solutions"]
        else row.get("solutions") or []
    )
    question = row["question"] + "\nRead from standard input and write to standard output."
    return {"question": question, "solution": solutions[0] if solutions else "", "tests": tests}, 0


def from_native(row: dict[str, Any], shown: int) -> tuple[dict[str, Any] | None, int]:
    """asyncrl's own layout: ``question``, ``tests`` (sandbox tests), optional ``solution`` and ``setup``."""
    return {k: row[k] for k in ("question", "tests", "solution", "setup") if k in row}, 0


FORMATS = {"native": from_native, "mbpp": from_mbpp, "humaneval": from_humaneval, "apps": from_apps}
# which layout a hub dataset uses; any other dataset's layout is told by its fields (format=auto)
PRESETS = {
    "google-research-datasets/mbpp": "mbpp",
    "mbpp": "mbpp",
    "openai/openai_humaneval": "humaneval",
    "openai_humaneval": "humaneval",
    "codeparrot/apps": "apps",
}


def detect_format(row: dict[str, Any]) -> str | None:
    """The layout of a record, from its fields; ``None`` if it is none of :data:`FORMATS`."""
    for key, name in (
        ("tests", "native"),
        ("test_list", "mbpp"),
        ("entry_point", "humaneval"),
        ("input_output", "apps"),
    ):
        if key in row:
            return name
    return None
