"""``asyncrl <command> -m key=a,b ...`` run from inside an experiment folder (``experiments/NAME/``, a
``dvc.yaml`` and ``params.yaml`` there, as ``asyncrl new experiment`` writes): each combination is queued as
a DVC experiment of that folder's pipeline
(``dvc exp run --queue experiments/NAME/dvc.yaml -S experiments/NAME/params.yaml:key=value``) instead of run
in place, so every run is versioned by DVC beside the folder's own: ``dvc queue start`` runs them,
``dvc exp show`` compares them, and each reruns only the stages its keys reach. The command named (``rl``,
``eval``...) does not narrow that: the folder's pipeline decides what runs.

Every combination is checked against the folder's params file first, and the folder must be committed:
``dvc exp run`` runs in a copy of the last commit, where an uncommitted folder does not exist.
``--config-file`` opts out (the sweep then runs in place, as anywhere else).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.config.compose import load_config
from asyncrl.launcher.sweep import expand


def experiment_folder(cwd: Path) -> Path | None:
    """The experiment folder ``cwd`` is in (``<repo>/experiments/<name>/`` holding ``dvc.yaml`` and
    ``params.yaml``), else ``None``."""
    for folder in (cwd, *cwd.parents):
        if folder.parent.name == "experiments" and all(
            (folder / f).is_file() for f in ("dvc.yaml", "params.yaml")
        ):
            return folder
    return None


def commands(folder: Path, overrides: list[str]) -> list[list[str]]:
    """The ``dvc exp run --queue`` command line of each combination (run from the repository root), every
    combination's config checked against the folder's params file; :class:`ConfigError` names the run and
    key."""
    root = folder.parents[1]
    params = (folder / "params.yaml").relative_to(root)
    combos, _ = expand(overrides)
    problems = []
    for i, combo in enumerate(combos):
        if bad := [o for o in combo if o.startswith(("+", "~"))]:
            problems.append(
                f"run {i}: {bad[0]}: a DVC experiment sets keys of {params} (key=value), adds none"
            )
            continue
        try:
            load_config(combo, root / params)
        except ConfigError as e:
            problems.append(f"run {i} ({' '.join(combo)}): {e}")
    if problems:
        raise ConfigError("the sweep is refused, nothing was queued:\n" + "\n".join(problems))
    pipeline = str((folder / "dvc.yaml").relative_to(root))
    return [
        ["dvc", "exp", "run", "--queue", pipeline, *(a for o in c for a in ("-S", f"{params}:{o}"))]
        for c in combos
    ]


def committed(folder: Path) -> bool:
    """Whether git has the folder's ``dvc.yaml`` and ``params.yaml`` committed, unchanged."""
    names = ["dvc.yaml", "params.yaml"]
    known = subprocess.run(["git", "ls-files", "--error-unmatch", *names], cwd=folder, capture_output=True)
    changed = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", *names], cwd=folder, capture_output=True
    )
    return known.returncode == 0 and changed.returncode == 0


def queue(folder: Path, overrides: list[str], dry_run: bool = False) -> int:
    """Queue every combination (``dry_run``: print the commands only); the exit code."""
    runs = commands(folder, overrides)
    root, name = folder.parents[1], folder.relative_to(folder.parents[1])
    if dry_run:
        for i, cmd in enumerate(runs):
            print(f"run {i}: {' '.join(cmd)}")
        return 0
    if not committed(folder):
        raise ConfigError(
            f"{name} is not committed as it is: `dvc exp run` runs a copy of the last commit, so commit the "
            f"folder first (git add {name} && git commit), then sweep again"
        )
    print(
        f"sweep: inside {name}, each combination is queued as a DVC experiment of {name}/dvc.yaml",
        flush=True,
    )
    for i, cmd in enumerate(runs):
        # this environment's DVC, the one asyncrl is installed beside
        done = subprocess.run([sys.executable, "-m", *cmd], cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"sweep: run {i} was not queued: {' '.join(cmd)}\n{done.stdout}{done.stderr}", flush=True)
            return 1
        print(f"sweep: queued run {i}: {' '.join(cmd[5:])}", flush=True)
    print("sweep: start them with `dvc queue start -j 1` (from the repository root); `dvc queue status` "
          "follows them, `dvc exp show` compares them")  # fmt: skip
    return 0
