"""DVC experiments as a table: ``dvc exp show --json`` -> one row per experiment, params and metrics.

The input is DVC's documented JSON (DVC 3.x, ``dvc.repo.experiments.serialize.ExpState``): a list of
baselines (the workspace, then one entry per commit shown), each

```
{"rev": sha | "workspace", "name": branch | null, "error": null | {"msg", "type"},
 "data": {"timestamp": iso | null, "params": {file: {"data": {...}}}, "metrics": {file: {"data": {...}}}},
 "experiments": null | [{"name": exp, "executor": null | {"state": "queued" | "running" | "failed" | ...},
                         "revs": [ExpState, ...]}]}
```

:func:`parse_exp_show` flattens that into :class:`Experiment` records (pure), :func:`experiments_table`
makes the DataFrame, :func:`exp_show` runs DVC to get the JSON.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

INFO = ["rev", "baseline", "state", "created"]


@dataclass
class Experiment:
    """One row: a baseline commit, the workspace or an experiment derived from a baseline."""

    name: str
    rev: str
    baseline: str
    # "workspace", "baseline", or the executor's: "success" (default), "queued", "running", "failed"
    state: str
    created: str | None
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys, as DVC's table shows them: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _merge_files(files: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """``{file: {"data": {...}}}`` -> flat ``{key: value}`` and the files' errors. A key found in more than
    one file is written ``file:key`` (as ``dvc exp show`` does), others keep their bare name."""
    flat: dict[str, dict[str, Any]] = {}
    errors = []
    for path, entry in (files or {}).items():
        entry = entry or {}
        if entry.get("error"):
            errors.append(f"{path}: {_error_text(entry['error'])}")
        flat[path] = flatten(entry.get("data") or {})
    counts = Counter(k for values in flat.values() for k in values)
    merged = {
        (k if counts[k] == 1 else f"{path}:{k}"): v
        for path, values in flat.items()
        for k, v in values.items()
    }
    return merged, errors


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return ": ".join(str(error[k]) for k in ("type", "msg") if error.get(k)) or json.dumps(error)
    return str(error)


def _record(state: dict[str, Any], name: str, baseline: str, status: str) -> Experiment:
    data = state.get("data") or {}
    params, param_errors = _merge_files(data.get("params"))
    metrics, metric_errors = _merge_files(data.get("metrics"))
    errors = ([_error_text(state["error"])] if state.get("error") else []) + param_errors + metric_errors
    return Experiment(
        name=name,
        rev=state["rev"] if state["rev"] == "workspace" else state["rev"][:7],
        baseline=baseline,
        state=status,
        created=data.get("timestamp"),
        params=params,
        metrics=metrics,
        error="; ".join(errors) or None,
    )


def parse_exp_show(exp_show: list[dict[str, Any]], workspace: bool = False) -> list[Experiment]:
    """Flatten ``dvc exp show --json`` into records: each baseline, then its experiments (newest first,
    as DVC lists them; the tip of each, ``revs[0]``). The workspace row, which repeats whichever
    experiment was run or applied last, is left out unless ``workspace``."""
    if not isinstance(exp_show, list):
        raise ValueError(
            f"not `dvc exp show --json` output: expected a list of baselines, got {type(exp_show).__name__}"
        )
    out = []
    for base in exp_show:
        if "rev" not in base:
            raise ValueError(f"not `dvc exp show --json` output: a baseline without 'rev': {sorted(base)}")
        if base["rev"] == "workspace":
            if workspace:
                out.append(_record(base, "workspace", "workspace", "workspace"))
            continue
        base_name = base.get("name") or base["rev"][:7]
        out.append(_record(base, base_name, base_name, "baseline"))
        for exp in base.get("experiments") or []:
            if not exp.get("revs"):
                continue
            tip = exp["revs"][0]
            status = (exp.get("executor") or {}).get("state") or "success"
            out.append(_record(tip, exp.get("name") or tip.get("name") or tip["rev"][:7], base_name, status))
    return out


def experiments_table(records: list[Experiment], only_changed: bool = True) -> pd.DataFrame:
    """One row per experiment, indexed by its name, with two-level columns: ``("info", rev | baseline |
    state | created | error)``, ``("params", key)`` and ``("metrics", key)``. ``only_changed`` keeps the
    params whose values differ between the rows that have params (a queued experiment has none yet), as
    ``dvc exp show --only-changed`` does, or all of them for a single row; metrics are always all kept."""
    if not records:
        raise ValueError("no experiments: run `dvc exp run` (or `dvc repro` and commit) first")
    names = [r.name for r in records]
    info = pd.DataFrame(
        [{**{k: getattr(r, k) for k in INFO}, "error": r.error} for r in records], index=names
    )
    params = pd.DataFrame([r.params for r in records], index=names)
    metrics = pd.DataFrame([r.metrics for r in records], index=names)
    if only_changed and len(records) > 1:
        known = params[params.notna().any(axis=1)]
        params = params[[c for c in params.columns if known[c].astype(str).nunique(dropna=False) > 1]]
    table = pd.concat({"info": info, "params": params, "metrics": metrics}, axis=1)
    table.index.name = "experiment"
    return table


def numeric_columns(table: pd.DataFrame, group: str) -> list[str]:
    """Names of the numeric columns of one group (``"params"`` or ``"metrics"``) of an experiments table."""
    if group not in table.columns.get_level_values(0):
        return []
    sub = table[group]
    return [
        c
        for c in sub.columns
        if pd.api.types.is_numeric_dtype(sub[c]) and not pd.api.types.is_bool_dtype(sub[c])
    ]


def choose(
    options: list[str], wanted: str | None = None, preferred: tuple[str, ...] = (), what: str = "column"
) -> str:
    """``wanted`` if it is one of ``options`` (a ``ValueError`` listing them if not); without ``wanted``, the
    first of ``preferred`` present, bare or under a file (``file:key``, as a key several metrics files share
    is named; the RL eval's file first, as the SFT eval's is its baseline), else the first option."""
    if not options:
        raise ValueError(
            f"no numeric {what} to choose from: no experiment has one yet (`dvc exp run`, or `dvc repro` "
            "and commit, writes the eval's metrics)"
        )
    if wanted is not None:
        if wanted not in options:
            raise ValueError(f"{what} {wanted!r} is not one of {options}")
        return wanted
    for p in preferred:
        found = [o for o in options if o == p or o.endswith(f":{p}")]
        if found:
            return sorted(found, key=lambda o: "eval_rl" not in o.rpartition(":")[0])[0]
    return options[0]


def dvc_command() -> list[str]:
    """How to run DVC: this interpreter's module if installed here (the notebook kernel's venv), else the
    ``dvc`` on PATH."""
    if importlib.util.find_spec("dvc") is not None:
        return [sys.executable, "-m", "dvc"]
    if exe := shutil.which("dvc"):
        return [exe]
    raise FileNotFoundError("dvc is not installed: `pip install -e '.[notebooks]'` (or any DVC 3.x on PATH)")


def exp_show(repo: str | Path, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """``dvc exp show --json [args]`` in ``repo`` (e.g. ``"-A"`` for every branch), parsed."""
    repo = Path(repo)
    if not (repo / ".dvc").is_dir():
        raise FileNotFoundError(f"not a DVC repository (no .dvc/): {repo.resolve()}")
    proc = subprocess.run(
        [*dvc_command(), "exp", "show", "--json", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"`dvc exp show --json` failed in {repo} (exit {proc.returncode}):\n{proc.stderr.strip()}"
        )
    return json.loads(proc.stdout)
