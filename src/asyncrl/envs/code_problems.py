"""Generated function-writing problems for ``env.<name>.type=code``: families of small Python tasks with a
parameter (``scale`` by 3, by 7...), each with a reference solution and hidden tests on seeded random inputs.

The expected values come from running the *reference* solution here, in this process: it is asyncrl's own
source (the templates below), never model output, which only ever runs in the sandbox.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One kind of problem. ``describe`` and ``source`` are ``str.format`` templates over the parameters;
    ``inputs`` draws one call's positional arguments (``stdin`` text for an ``io`` family)."""

    name: str
    fn: str  # the function to write ('' for an io family: a program reading stdin)
    describe: str
    source: str
    params: Callable[[random.Random], dict[str, Any]]
    inputs: Callable[[random.Random, dict[str, Any]], Any]


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n_max: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, n_max))]


def _word(rng: random.Random, n_max: int = 8) -> str:
    return "".join(rng.choice("abcdeilmnorstu") for _ in range(rng.randint(1, n_max)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng, 6) for _ in range(rng.randint(1, 5)))


def _k(lo: int, hi: int) -> Callable[[random.Random], dict[str, Any]]:
    return lambda rng: {"k": rng.randint(lo, hi)}


FAMILIES: tuple[Family, ...] = (
    Family(
        "scale",
        "scale",
        "Write a Python function `scale(xs)` that returns a new list with every element of the list of "
        "integers `xs` multiplied by {k}.",
        "def scale(xs):\n    return [x * {k} for x in xs]",
        _k(2, 9),
        lambda rng, p: [_ints(rng)],
    ),
    Family(
        "count_char",
        "count_char",
        "Write a Python function `count_char(s)` that returns how many times the character "
        "'{c}' occurs in the string `s`.",
        "def count_char(s):\n    return s.count('{c}')",
        lambda rng: {"c": rng.choice("aeiorst")},
        lambda rng, p: [_sentence(rng)],
    ),
    Family(
        "sum_multiples",
        "sum_multiples",
        "Write a Python function `sum_multiples(xs)` that returns the sum of the elements of the list of "
        "integers `xs` that are divisible by {k}.",
        "def sum_multiples(xs):\n    return sum(x for x in xs if x % {k} == 0)",
        _k(2, 7),
        lambda rng, p: [_ints(rng, -30, 30)],
    ),
    Family(
        "count_above",
        "count_above",
        "Write a Python function `count_above(xs)` that returns how many elements of the "
        "list `xs` are greater than {k}.",
        "def count_above(xs):\n    return sum(1 for x in xs if x > {k})",
        _k(-5, 10),
        lambda rng, p: [_ints(rng)],
    ),
    Family(
        "clamp",
        "clamp",
        "Write a Python function `clamp(x)` that returns the integer `x` limited to the range [{lo}, {hi}]: "
        "{lo} if it is smaller, {hi} if it is larger, else `x`.",
        "def clamp(x):\n    return max({lo}, min({hi}, x))",
        lambda rng: (lambda lo: {"lo": lo, "hi": lo + rng.randint(1, 20)})(rng.randint(-10, 10)),
        lambda rng, p: [rng.randint(-40, 40)],
    ),
    Family(
        "rotate_left",
        "rotate_left",
        "Write a Python function `rotate_left(xs)` that returns the list `xs` rotated left by "
        "{k} positions (the first {k} elements move to the end; rotate by {k} modulo the "
        "length; an empty list stays empty).",
        "def rotate_left(xs):\n    if not xs:\n        return []\n    k = {k} % "
        "len(xs)\n    return xs[k:] + xs[:k]",
        _k(1, 5),
        lambda rng, p: [_ints(rng)],
    ),
    Family(
        "filter_longer",
        "filter_longer",
        "Write a Python function `filter_longer(words)` that returns the words of the list `words` that "
        "have more than {k} characters, in their original order.",
        "def filter_longer(words):\n    return [w for w in words if len(w) > {k}]",
        _k(2, 5),
        lambda rng, p: [[_word(rng) for _ in range(rng.randint(0, 6))]],
    ),
    Family(
        "caesar",
        "caesar",
        "Write a Python function `caesar(s)` that shifts every lowercase letter of the string "
        "`s` forward by {k} places in the alphabet, wrapping from 'z' to 'a', and leaves "
        "every other character unchanged.",
        "def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' "
        "<= c <= 'z' else c for c in s)",
        _k(1, 25),
        lambda rng, p: [_sentence(rng)],
    ),
    Family(
        "chunk",
        "chunk",
        "Write a Python function `chunk(xs)` that splits the list `xs` into consecutive lists of {k} "
        "elements (the last one may be shorter) and returns the list of them.",
        "def chunk(xs):\n    return [xs[i:i + {k}] for i in range(0, len(xs), {k})]",
        _k(1, 4),
        lambda rng, p: [_ints(rng, n_max=10)],
    ),
    Family(
        "power_sum",
        "power_sum",
        "Write a Python function `power_sum(n)` that returns the sum of i**{k} for i from 1 to `n` "
        "inclusive (0 when `n` is smaller than 1).",
        "def power_sum(n):\n    return sum(i ** {k} for i in range(1, n + 1))",
        _k(1, 4),
        lambda rng, p: [rng.randint(-2, 30)],
    ),
    Family(
        "fizzbuzz",
        "fizzbuzz",
        "Write a Python function `fizzbuzz(n)` that returns a list of strings for the numbers 1 to `n`: "
        "'FizzBuzz' if the number is divisible by both {a} and {b}, 'Fizz' if only by {a}, 'Buzz' if only "
        "by {b}, else the number itself as a string.",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % {a} == 0 "
        "else '') + ('Buzz' if i % {b} == 0 else '')\n        out.append(s or str(i))\n    return out",
        lambda rng: dict(zip("ab", rng.sample(range(2, 8), 2), strict=True)),
        lambda rng, p: [rng.randint(0, 25)],
    ),
    Family(
        "reverse_words",
        "reverse_words",
        "Write a Python function `reverse_words(s)` that returns the words of the string `s` (separated by "
        "single spaces) in reverse order, joined by single spaces.",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split(' ')))",
        lambda rng: {},
        lambda rng, p: [_sentence(rng)],
    ),
    Family(
        "is_palindrome",
        "is_palindrome",
        "Write a Python function `is_palindrome(s)` that returns True if the string `s` reads "
        "the same backwards, else False.",
        "def is_palindrome(s):\n    return s == s[::-1]",
        lambda rng: {},
        lambda rng, p: [rng.choice([_word(rng), (lambda w: w + w[::-1][rng.randint(0, 1) :])(_word(rng))])],
    ),
    Family(
        "second_largest",
        "second_largest",
        "Write a Python function `second_largest(xs)` that returns the second largest distinct value of the "
        "list of integers `xs`, or None if it has fewer than two distinct values.",
        "def second_largest(xs):\n    values = sorted(set(xs))\n    return "
        "values[-2] if len(values) > 1 else None",
        lambda rng: {},
        lambda rng, p: [_ints(rng, -9, 9)],
    ),
    Family(
        "dedupe",
        "dedupe",
        "Write a Python function `dedupe(xs)` that returns the list `xs` without repeated values, keeping "
        "the first occurrence of each, in order.",
        "def dedupe(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out",
        lambda rng: {},
        lambda rng, p: [_ints(rng, 0, 6, 10)],
    ),
    Family(
        "max_run",
        "max_run",
        "Write a Python function `max_run(xs)` that returns the length of the longest run of equal "
        "consecutive elements in the list `xs` (0 for an empty list).",
        "def max_run(xs):\n    best = run = 0\n    for i, x in enumerate(xs):\n        run = run + 1 if i "
        "and x == xs[i - 1] else 1\n        best = max(best, run)\n    return best",
        lambda rng: {},
        lambda rng, p: [_ints(rng, 0, 2, 10)],
    ),
    Family(
        "digit_sum",
        "digit_sum",
        "Write a Python function `digit_sum(n)` that returns the sum of the decimal digits of the "
        "absolute value of the integer `n`.",
        "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))",
        lambda rng: {},
        lambda rng, p: [rng.randint(-99999, 99999)],
    ),
    Family(
        "stdin_sum",
        "",
        "Write a Python program that reads one line of space-separated integers from standard input and "
        "prints their sum multiplied by {k}.",
        "print(sum(int(t) for t in input().split()) * {k})",
        _k(2, 9),
        lambda rng, p: " ".join(map(str, _ints(rng) or [0])) + "\n",
    ),
    Family(
        "stdin_upper",
        "",
        "Write a Python program that reads lines from standard input until it ends and prints each line in "
        "upper case, with the lines in reverse order.",
        "import sys\nfor line in reversed(sys.stdin.read().splitlines()):\n    print(line.upper())",
        lambda rng: {},
        lambda rng, p: "".join(_sentence(rng) + "\n" for _ in range(rng.randint(1, 4))),
    ),
)


def reference(source: str, fn: str) -> Callable[..., Any]:
    """The reference solution as a callable (our template, see the module's docstring)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {fn}>", "exec"), namespace)  # noqa: S102 (asyncrl's own templates)
    return namespace[fn]


def _run_io(source: str, stdin: str) -> str:
    """The reference io program's output, run in-process on ``stdin`` (our template, see the docstring)."""
    out, saved = io.StringIO(), sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<reference program>", "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        sys.stdin = saved
    return out.getvalue()


def _call_repr(fn: str, args: list[Any]) -> str:
    return f"{fn}({', '.join(repr(a) for a in args)})"


def problem(family: Family, rng: random.Random, num_tests: int) -> dict[str, Any]:
    """One problem of ``family``: the question (with one worked example), the reference solution, and
    ``num_tests`` hidden tests on fresh inputs (the example's input is not among them)."""
    params = family.params(rng)
    source = family.source.format(**params)
    draws, seen = [], set()
    for _ in range(20 * (num_tests + 1)):  # distinct inputs; small input spaces may give fewer
        x = family.inputs(rng, params)
        if repr(x) not in seen:
            seen.add(repr(x))
            draws.append(x)
        if len(draws) == num_tests + 1:
            break
    question = family.describe.format(**params)
    if family.fn:
        f = reference(source, family.fn)
        shown, *hidden = draws
        question += f" For example, {_call_repr(family.fn, shown)} == {f(*shown)!r}."
        tests = [
            {"kind": "call", "fn": family.fn, "args": a, "kwargs": {}, "expected": f(*a)} for a in hidden
        ]
    else:
        shown, *hidden = draws
        question += f" For example, on the input {shown!r} it prints {_run_io(source, shown)!r}."
        tests = [{"kind": "io", "stdin": s, "expected": _run_io(source, s)} for s in hidden]
    return {"family": family.name, "question": question, "solution": source, "tests": tests}


def generate(
    size: int, seed: int, num_tests: int, families: list[str] | None = None
) -> list[dict[str, Any]]:
    """``size`` problems drawn uniformly from ``families`` (default: all), seeded."""
    chosen = [f for f in FAMILIES if not families or f.name in families]
    rng = random.Random(f"{seed}:code")
    return [problem(rng.choice(chosen), rng, num_tests) for _ in range(size)]


FAMILY_NAMES = tuple(f.name for f in FAMILIES)
