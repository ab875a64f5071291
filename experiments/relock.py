"""Re-make every DVC lock: the root dvc.yaml and each experiments/*/dvc.yaml that has a dvc.lock.

    python experiments/relock.py         # `make relock`: `dvc repro -f` each pipeline (the root's ~7 min on
                                         # 2 cores, the experiments' about an hour), then which outs changed
    python experiments/relock.py --code  # `make relock CODE=1`: for a refactor. A forced rerun of the root
                                         # pipeline only; if every out hashes as before, the experiments'
                                         # locks take the new hashes of their src/ deps and params without
                                         # a rerun

Both first write each params.yaml (the root's, experiments/*/params.yaml) as the current composition of its
experiment, so a config key added to the schema reaches the locks. Each run prints, per pipeline, every out
whose md5 changed (or `outs unchanged`), comparing the lock before and after. --code is honest only for a
change that leaves results alone: the root pipeline's forced rerun is its check (prepare, sft, rl and eval
reproduce their outs bit for bit), and the experiments run the same stages' code with other params; a param
they record may gain keys (a new setting at a default that runs the same code) or move with its value
(config/renamed.py) but not change or lose one. Where a root out or an experiment's recorded param changes it
stops and re-records nothing: run the full relock. experiments/reverse_text/dvc.lock, the default run's
record, is the root lock copied."""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "experiments" / "reverse_text" / "dvc.lock"


def pipelines() -> list[Path]:
    locked = [
        p for p in sorted((ROOT / "experiments").glob("*/dvc.yaml")) if p.with_suffix(".lock").exists()
    ]
    return [ROOT / "dvc.yaml", *locked]


def outs(lock: Path) -> dict[str, str]:
    """out path (per stage) -> md5, as the lock records them."""
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.exists() else {}
    return {
        f"{name}: {o['path']}": o.get("md5", "") for name, s in stages.items() for o in s.get("outs", [])
    }


def report(pipeline: Path, before: dict[str, str], after: dict[str, str]) -> bool:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    print(
        f"{pipeline.relative_to(ROOT)}: "
        + ("outs unchanged" if not changed else f"{len(changed)} outs changed")
    )
    for key in changed:
        print(f"  {key}: {before.get(key, '(none)')} -> {after.get(key, '(none)')}")
    return bool(changed)


def repro(pipeline: Path) -> bool:
    lock = pipeline.with_suffix(".lock")
    before = outs(lock)
    subprocess.run(["dvc", "repro", "-f", str(pipeline.relative_to(ROOT))], cwd=ROOT, check=True)
    return report(pipeline, before, outs(lock))


def compose_params() -> None:
    """Write each params.yaml as `asyncrl prepare --cfg experiment=<its name>` composes it now."""
    for path in [ROOT / "params.yaml", *sorted((ROOT / "experiments").glob("*/params.yaml"))]:
        name = yaml.safe_load(path.read_text())["name"]
        cmd = ["asyncrl", "prepare", "--cfg", f"experiment={name}"]
        path.write_text(subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


def moved_to_new_keys(recorded: object) -> object:
    """``recorded`` (a stage's params as its lock holds them) with every key that moved
    (:data:`asyncrl.config.renamed.RENAMED`) at its new place: a move that keeps the value changes
    nothing."""
    from asyncrl.config.renamed import RENAMED  # lazy: only --code compares params

    if not isinstance(recorded, dict):
        return recorded
    out = copy.deepcopy(recorded)
    for old, new in RENAMED.items():
        *parents, leaf = old.split(".")
        section = out
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and leaf in section:
            value = section.pop(leaf)
            *new_parents, new_leaf = new.split(".")
            target = out
            for part in new_parents:
                target = target.setdefault(part, {})
            target.setdefault(new_leaf, value)
    return out


def changed_params(recorded: object, current: object, where: str = "") -> list[str]:
    """The keys whose recorded value ``current`` changes or drops; keys it adds are not listed."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        return [
            key
            for k, v in recorded.items()
            for key in (
                changed_params(v, current[k], f"{where}{k}.") if k in current else [f"{where}{k} (dropped)"]
            )
        ]
    same = recorded == current or (isinstance(current, tuple) and list(current) == recorded)
    return [] if same else [where.removesuffix(".")]


def record_code_deps(pipelines: list[Path]) -> int:
    """Re-hash the src/ deps and the params of each stage of ``pipelines`` into their locks, outs and other
    deps as recorded; nothing is written where a recorded param changed (1)."""
    # lazy: DVC's Python API, which only this mode needs, takes seconds to import
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = [s for s in repo.index.stages if Path(s.dvcfile.path).resolve() in pipelines]
        params = [(s, d) for s in stages for d in s.deps if isinstance(d, ParamsDependency)]
        changed = [
            f"{s.addressing}: {k}"
            for s, d in params
            for k in (
                changed_params(moved_to_new_keys(d.hash_info.value), d.get_hash().value)
                if d.hash_info
                else ["(never recorded)"]
            )
        ]
        if changed:
            print("recorded params changed (run `make relock`):\n  " + "\n  ".join(changed), file=sys.stderr)
            return 1
        for stage in stages:
            for dep in stage.deps:
                if isinstance(dep, ParamsDependency) or Path(dep.fs_path).resolve().is_relative_to(
                    ROOT / "src"
                ):
                    dep.save()
            stage.dump(update_pipeline=False)
    for pipeline in pipelines:
        print(f"{pipeline.relative_to(ROOT)}: src/ deps and params re-recorded, outs as they were")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--code", action="store_true", help="a refactor: check the root pipeline, then re-hash code"
    )
    args = parser.parse_args()
    os.chdir(ROOT)
    compose_params()
    root, *experiments = pipelines()
    changed = repro(root)
    shutil.copyfile(ROOT / "dvc.lock", RECORD)
    if args.code:
        if changed:
            print(
                "the root pipeline's outs changed: not a pure refactor; run `make relock`", file=sys.stderr
            )
            return 1
        return record_code_deps(experiments)
    for pipeline in experiments:
        changed |= repro(pipeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
