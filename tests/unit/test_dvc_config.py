"""The DVC pipeline's wiring, checked without running it (tests/integration/test_dvc.py runs it).

params.yaml must be what `dvc exp run` composes from conf/ (else `dvc repro` and `dvc exp run` run different
configs), every config section must be a param of the stages that read it (else changing it reruns nothing),
and experiments/reverse_text must pin the run that the committed dvc.lock records.
"""

import configparser
import dataclasses
import subprocess
import sys
from pathlib import Path

import yaml

from asyncrl.config import Config
from helpers.launch import asyncrl

ROOT = Path(__file__).resolve().parents[2]
# config sections that no stage lists as a param, and why: paths (they name the outs, and DVC tracks the
# `${...}` values it interpolates), checkpoint cadence, W&B logging and process supervision (none changes
# results)
UNTRACKED = {"name", "output_dir", "run_dir", "ckpt", "monitor", "launcher"}
REGENERATE = "asyncrl prepare --cfg experiment=reverse_text > params.yaml"


def hydra_settings() -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".dvc" / "config")
    return parser["hydra"]


def test_params_yaml_is_what_dvc_exp_run_composes(tmp_path):
    """DVC's own composition (dvc/utils/hydra.py, as `dvc exp run` calls it) in a fresh process, where only
    the plugin of .dvc/config [hydra] plugins_path can register asyncrl's schema."""
    hydra = hydra_settings()
    assert hydra.getboolean("enabled")
    out = tmp_path / "params.yaml"
    code = (
        "import sys; from dvc.utils.hydra import compose_and_dump; "
        "compose_and_dump(sys.argv[1], sys.argv[2], None, sys.argv[3], sys.argv[4], [])"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(out),
            str(ROOT / hydra["config_dir"]),
            hydra["config_name"],
            str(ROOT / hydra["plugins_path"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    composed = out.read_text()
    assert (ROOT / "params.yaml").read_text() == composed, (
        f"params.yaml is stale: `{REGENERATE}`, then `dvc repro`"
    )
    # and the command that the message above gives writes exactly that file
    assert asyncrl("prepare", "--cfg", "experiment=reverse_text", check=True).stdout == composed


def test_experiment_pipelines_read_the_current_composition_of_their_experiment():
    """An experiment with a DVC pipeline of its own (experiments/<name>/dvc.yaml) reads
    experiments/<name>/params.yaml, the resolved `experiment=<name>`: stale, `dvc repro` would run an older
    config than `asyncrl ... experiment=`."""
    files = sorted(ROOT.glob("experiments/*/params.yaml"))
    assert files, "no experiment pipeline found"
    for path in files:
        name = yaml.safe_load(path.read_text())["name"]
        composed = asyncrl("prepare", "--cfg", f"experiment={name}", check=True).stdout
        rel = path.relative_to(ROOT)
        assert path.read_text() == composed, (
            f"{rel} is stale: `asyncrl prepare --cfg experiment={name} > {rel}`"
        )


def test_every_config_section_is_a_param_of_a_stage():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    tracked = set()
    for stage in stages.values():
        for entry in stage.get("do", stage).get("params", []):
            keys = [entry] if isinstance(entry, str) else [k for keys in entry.values() for k in keys]
            tracked |= {k.split(".")[0] for k in keys}
    sections = {f.name for f in dataclasses.fields(Config)}
    assert tracked <= sections, (
        f"dvc.yaml lists params that are not config keys: {sorted(tracked - sections)}"
    )
    missing = sections - tracked - UNTRACKED
    assert not missing, (
        f"config sections {sorted(missing)} are params of no stage in dvc.yaml: add them to the "
        "stages that read them (or to UNTRACKED here, with the reason)"
    )


def test_default_experiment_pins_the_committed_lock():
    def outs(path: Path) -> dict:
        lock = yaml.safe_load(path.read_text())["stages"]
        return {name: {o["path"]: o["md5"] for o in stage.get("outs", [])} for name, stage in lock.items()}

    pinned = outs(ROOT / "experiments" / "reverse_text" / "dvc.lock")
    assert set(pinned) == {"prepare", "sft", "rl", "eval@sft", "eval@rl"}
    assert outs(ROOT / "dvc.lock") == pinned, (
        "dvc.lock's outs differ from experiments/reverse_text/dvc.lock: "
        "a new default run? copy the lock there and update its README table"
    )
