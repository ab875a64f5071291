"""``asyncrl <command> -m key=a,b ...``: Hydra's multirun, one run after another on this machine.

The overrides expand as Hydra's basic sweeper expands them (``a,b`` choices, ``range(...)``, ``glob(...)``;
the cartesian product of every swept key), and each combination runs as its own ``asyncrl <command>`` process
with its own directory: ``<dir>/<i>_<key>-<value>_...`` under the directory the command writes (``run_dir``
for ``rl``, ``sft.run_dir``, ``eval.out_dir``, ``data_dir`` for ``prepare``). Every combination's config is
composed and checked before the first starts, so a mistake in one refuses the sweep. A run that fails does
not stop the others; the sweep exits 1 if any did. ``<dir>/sweep.json`` records each run's overrides,
directory, exit code, time and headline metrics, and a table of them is printed at the end. Run from inside
an experiment folder, the sweep is queued as DVC experiments of its pipeline instead
(:mod:`asyncrl.launcher.dvc_sweep`).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Hydra's own expansion (the basic sweeper's), not a copy of its rules
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from asyncrl.config import ConfigError
from asyncrl.config.compose import load_config
from asyncrl.launcher.preflight import WRITES, config_value, preflight
from asyncrl.utils.atomic import write_json_atomic

# the commands a sweep runs: each writes one directory (preflight.WRITES), which the sweep splits per run
SWEEPS = ("prepare", "sft", "rl", "eval")
# where each command leaves its headline numbers, relative to its directory
RESULTS = {"rl": "metrics/summary.json", "eval": "metrics.json", "sft": "metrics/sft.jsonl"}


@dataclass
class Job:
    index: int
    swept: dict[str, str]  # the swept keys' values of this run, as given
    overrides: list[str]  # every override of this run, its directory's last
    out_dir: str
    returncode: int | None = None
    seconds: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def expand(overrides: list[str]) -> tuple[list[list[str]], list[str]]:
    """Hydra's sweep expansion of ``overrides``: every combination's overrides, and the swept keys (at least
    one, else :class:`ConfigError`)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        combos = BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException as e:
        raise ConfigError(f"invalid sweep: {e}") from None
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    if not swept:
        raise ConfigError("-m needs a swept key, e.g. trainer.optim.lr=1e-4,3e-4 (Hydra's choice syntax)")
    return combos, swept


def plan(command: str, overrides: list[str], config_file: str | None, config_dirs: list[str]) -> list[Job]:
    """The sweep's runs, each config composed and checked (nothing created); raises :class:`ConfigError`
    naming the run and its problem for every combination that would fail."""
    if command not in SWEEPS:
        raise ConfigError(
            f"-m (sweep) runs {', '.join(SWEEPS)}; `asyncrl {command}` is one process of a run, started by "
            "`asyncrl rl` (sweep that), or serves until stopped"
        )
    combos, swept = expand(overrides)
    key = WRITES[command][0]
    base = Path(str(config_value(load_config(combos[0], config_file, config_dirs), key)))
    jobs: list[Job] = []
    problems: dict[str, list[str]] = {}  # the problem's text -> the runs that have it
    for i, combo in enumerate(combos):
        values = {k: v for k, _, v in (o.partition("=") for o in combo) if k.lstrip("+~") in swept}
        name = f"{i}_" + "_".join(f"{k.lstrip('+~').rsplit('.', 1)[-1]}-{v}" for k, v in values.items())
        # a plain override value, a plain file name
        out_dir = str(base / re.sub(r"[^A-Za-z0-9._-]", "_", name))
        job = Job(
            i, values, [o for o in combo if o.partition("=")[0] != key] + [f"{key}={out_dir}"], out_dir
        )
        try:
            preflight(load_config(job.overrides, config_file, config_dirs), command, create=False)
        except (ConfigError, FileNotFoundError) as e:
            problems.setdefault(str(e), []).append(f"{i} ({', '.join(values.values())})")
        jobs.append(job)
    if problems:
        lines = [
            f"run{'s' if len(runs) > 1 else ''} {', '.join(runs)}: {text}" for text, runs in problems.items()
        ]
        raise ConfigError("the sweep is refused, nothing ran:\n" + "\n".join(lines))
    return jobs


def run(command: str, jobs: list[Job], flags: list[str]) -> int:
    """Run ``jobs`` one after another (``flags``: the CLI's ``--config-file`` / ``--config-dir``); write
    ``sweep.json`` beside their directories and print the summary. 0 when every run succeeded."""
    sweep_file = Path(jobs[0].out_dir).parent / "sweep.json"
    for job in jobs:
        print(
            f"sweep: run {job.index + 1}/{len(jobs)}: asyncrl {command} {' '.join(job.overrides)}",
            flush=True,
        )
        t = time.monotonic()
        job.returncode = subprocess.run(
            [sys.executable, "-m", "asyncrl", command, *job.overrides, *flags]
        ).returncode
        job.seconds = round(time.monotonic() - t, 1)
        job.metrics = headline(command, Path(job.out_dir))
        write_json_atomic(sweep_file, {"command": command, "runs": [asdict(j) for j in jobs]})
    print(summary(jobs), flush=True)
    print(f"sweep: {sweep_file}", flush=True)
    return 0 if all(j.returncode == 0 for j in jobs) else 1


def headline(command: str, out_dir: Path) -> dict[str, float]:
    """The numbers a run left in its result file (``RESULTS``; the last row of a metrics log), finite ones
    only."""
    path = out_dir / RESULTS[command] if command in RESULTS else None
    if path is None or not path.is_file():
        return {}
    try:
        text = path.read_text()
        row = json.loads(text.strip().splitlines()[-1]) if path.suffix == ".jsonl" else json.loads(text)
    except (ValueError, IndexError, OSError):
        return {}
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: v for k, v in numbers.items() if math.isfinite(v)}


def summary(jobs: list[Job], columns: int = 6) -> str:
    """A table: each run's swept values, exit code, time and up to ``columns`` metrics (those every run has
    first)."""
    keys = sorted(
        {k for j in jobs for k in j.metrics}, key=lambda k: (-sum(k in j.metrics for j in jobs), k)
    )
    keys = keys[:columns]
    swept = list(jobs[0].swept)
    header = ["run", *swept, "exit", "s", *keys]
    rows = [
        [str(j.index), *(j.swept.get(k, "") for k in swept), str(j.returncode), f"{j.seconds or 0:.0f}",
         *(f"{j.metrics[k]:.4g}" if k in j.metrics else "" for k in keys)]
        for j in jobs
    ]  # fmt: skip
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )
