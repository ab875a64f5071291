"""Summaries of py-spy's raw (collapsed-stack) profiles: where each process and thread of a program spent its
samples.

``py-spy record --format raw --subprocesses --threads`` writes one line per distinct stack,
``frame;frame;... count``, root first; with ``--subprocesses`` the root frame names the process
(``process 123:"python -c ..."``) and with ``--threads`` the next one the thread (``thread (0x7f..)``).
:func:`summarize` turns that into, per process and thread, the samples and the functions with the most
samples of their own (the leaf frame) and in total (anywhere on the stack). Used by
``logprobs_cost.py --pyspy`` to find where vLLM's engine core and frontend spend the time logprobs cost;
runnable on saved files too:

    python benchmarks/pyspy_summary.py $OUT/pyspy_logprobs.txt [--top 25]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$", re.DOTALL)
_PROCESS = re.compile(r'^process (\d+):"(.*)"$', re.DOTALL)


def _records(raw: str) -> list[str]:
    """The raw profile's stacks. One a line, except that a process frame holds its command line as it is,
    newlines too (``python -c`` with a script): with ``--subprocesses`` every stack starts with
    ``process <pid>:``."""
    if raw.startswith("process "):
        return re.split(r"\n(?=process \d+:)", raw)
    return raw.splitlines()


def _short(process: str) -> str:
    """``process <pid>: <the command line's first 60 characters, on one line>``."""
    m = _PROCESS.match(process)
    return f"process {m.group(1)}: {' '.join(m.group(2).split())[:60]}" if m else process


def _where(frames: list[str]) -> tuple[str, str, list[str]]:
    """(process, thread, the Python frames) of one stack; "-" where the profile has no such frame. The
    process frame is everything before the thread frame: a command line may hold ';' (``python -c "a; b"``),
    which the raw format does not escape."""
    at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
    if at is not None:
        # a forked child's stacks name its parent first, then itself: the last process frame is the one
        start = max((i for i in range(at) if re.match(r"process \d+:", frames[i])), default=0)
        return ";".join(frames[start:at]) or "-", frames[at], frames[at + 1 :]
    if frames and frames[0].startswith("process "):
        return frames[0], "-", frames[1:]
    return "-", "-", frames


def summarize(raw: str, top: int = 25) -> dict:
    """Per ``"<process> / <thread>"``: ``samples``, ``self`` (the ``top`` leaf functions by samples) and
    ``total`` (the ``top`` functions by samples with that function anywhere on the stack, counted once a
    stack). Lines that are not ``stack count`` are skipped."""
    samples: Counter[str] = Counter()
    own: dict[str, Counter[str]] = {}
    anywhere: dict[str, Counter[str]] = {}
    for record in _records(raw):
        m = _LINE.match(record.strip())
        if not m:
            continue
        count = int(m.group(2))
        process, thread, frames = _where(m.group(1).split(";"))
        process = _short(process)
        key = f"{process} / {thread}"
        samples[key] += count
        if frames:
            own.setdefault(key, Counter())[frames[-1]] += count
            for f in set(frames):
                anywhere.setdefault(key, Counter())[f] += count
    return {
        key: {
            "samples": n,
            "self": own.get(key, Counter()).most_common(top),
            "total": anywhere.get(key, Counter()).most_common(top),
        }
        for key, n in samples.most_common()
    }


def render(summary: dict, top: int = 12, min_share: float = 0.02) -> str:
    """A short text report of :func:`summarize`'s result: the busiest threads first, those with fewer than
    ``min_share`` of the busiest one's samples left out."""
    out = []
    busiest = max((s["samples"] for s in summary.values()), default=0)
    for key, s in summary.items():
        if s["samples"] < min_share * busiest:
            continue
        out.append(f"{key}: {s['samples']} samples")
        for name, n in s["self"][:top]:
            out.append(f"  self {n:>6} {100 * n / s['samples']:5.1f}%  {name}")
        for name, n in s["total"][:top]:
            out.append(f"  all  {n:>6} {100 * n / s['samples']:5.1f}%  {name}")
    return "\n".join(out)


def record(
    pyspy: str,
    pid: int,
    path: Path,
    seconds: int,
    work: Callable[[], object] | None,
    rate: int = 200,
    idle: bool = False,
    children: bool = True,
) -> dict:
    """Run ``work()`` again and again for ``seconds`` (None: only wait) while py-spy records ``pid`` (and its
    children) threads apart into ``path`` (raw format).
    ``{"path", "results" (work's returns), "returncode", "log", "summary" (rendered)}``."""
    cmd = [pyspy, "record", "--pid", str(pid), "--threads", "--nonblocking", "--format", "raw",
           "--rate", str(rate), "--duration", str(seconds), "--output", str(path)]  # fmt: skip
    cmd += (["--idle"] if idle else []) + (["--subprocesses"] if children else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2)  # attached to every process
    t0, results = time.time(), []
    while work is not None and time.time() - t0 < seconds - 5:
        results.append(work())
    log = p.communicate(timeout=seconds + 120)[0]
    text = render(summarize(path.read_text())) if path.exists() else ""
    return {
        "path": str(path),
        "results": results,
        "returncode": p.returncode,
        "log": log[-1500:],
        "summary": text,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args()
    for path in args.raw:
        summary = summarize(path.read_text(), args.top)
        print(json.dumps(summary, indent=1) if args.json else f"== {path}\n{render(summary, args.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
