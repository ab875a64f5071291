"""``asyncrl new experiment NAME [--env ENV]... [key=value ...]``: an experiment folder that ``dvc repro``
runs.

It writes, in the repository it is run from (the folder holding ``dvc.yaml`` and ``conf/``):

- ``conf/experiment/NAME.yaml``: the Hydra experiment, the root pipeline's experiment
  (``conf/pipeline.yaml``) with its settings copied, another environment where ``--env`` names one, the
  overrides given, and its own ``output_dir``, data and tiny model, so its outs never collide with the root
  pipeline's; ``asyncrl rl experiment=NAME`` runs it by hand too;
- ``experiments/NAME/params.yaml``: its resolved config (``asyncrl prepare --cfg experiment=NAME``, which
  ``make relock`` and a test keep current);
- ``experiments/NAME/dvc.yaml``: the root ``dvc.yaml``'s stages run from the repository root
  (``wdir: ../..``), reading that params file, each stage that reads the environment also depending on the
  packages in ``environments/`` whose code the environments run (:func:`env_packages`);
- ``experiments/NAME/README.md``: the question, setup and results headings, and the commands.

Everything is checked (the name, the environments, the overrides composed) before anything is written, and an
existing experiment of that name is refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
USAGE = "asyncrl new experiment NAME [--env ENV]... [key=value ...] [--force]"


class Refused(Exception):
    """What is wrong with the command line or the repository, said to the user as is."""


def repo_root(start: Path) -> Path:
    """The repository ``start`` is in: the nearest folder above it holding ``dvc.yaml`` and
    ``conf/pipeline.yaml``."""
    for folder in (start, *start.parents):
        if (folder / "dvc.yaml").is_file() and (folder / "conf" / "pipeline.yaml").is_file():
            return folder
    raise Refused(
        f"{start} is not inside an asyncrl repository (no dvc.yaml and conf/pipeline.yaml above it)"
    )


def nested(overrides: list[str], groups: set[str]) -> tuple[dict, dict[str, str]]:
    """``key=value`` overrides as a nested mapping, and the config-group choices among them
    (``model=hf``)."""
    body: dict = {}
    choices: dict[str, str] = {}
    for item in overrides:
        if "=" not in item or item.startswith(("+", "~")):
            raise Refused(f"override {item!r}: expected key=value (the experiment file holds plain keys)")
        key, value = item.split("=", 1)
        if key in groups:
            choices[key] = value
            continue
        *parents, leaf = key.split(".")
        node = body
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return body, choices


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def base_experiment(root: Path) -> tuple[str, dict]:
    """The root pipeline's experiment: its name (``conf/pipeline.yaml``'s ``override experiment``) and file,
    with the pipeline file's own settings (``numerics``) over it."""
    pipeline = yaml.safe_load((root / "conf" / "pipeline.yaml").read_text())
    name = next(
        v for d in pipeline["defaults"] if isinstance(d, dict) for k, v in d.items() if "experiment" in k
    )
    body = yaml.safe_load((root / "conf" / "experiment" / f"{name}.yaml").read_text())
    return name, merge(body, {k: v for k, v in pipeline.items() if k != "defaults"})


def experiment_config(root: Path, name: str, envs: list[str], overrides: list[str]) -> tuple[str, dict]:
    """``conf/experiment/NAME.yaml`` as a mapping (see the module's docstring), and the experiment it starts
    from."""
    groups = {p.name for p in (root / "conf").iterdir() if p.is_dir()}
    for env in envs:
        if not (root / "conf" / "env" / f"{env}.yaml").is_file():
            known = sorted(p.stem for p in (root / "conf" / "env").glob("*.yaml"))
            raise Refused(f"--env {env}: no conf/env/{env}.yaml (environments: {', '.join(known)})")
    base_name, base = base_experiment(root)
    body, choices = nested(overrides, groups)
    defaults, model = [], choices.get("model")
    for d in base.get("defaults", []):
        group = next(iter(d)).split("/")[-1] if isinstance(d, dict) else None
        if group == "model" and model is None:
            model = d[next(iter(d))]
        if not (group == "env" and envs) and group not in choices:
            defaults.append(d)
    if envs:
        defaults.append({"override /env": envs})
    defaults += [{f"override /{group}": value} for group, value in choices.items()]
    settings = {k: v for k, v in base.items() if k not in ("defaults", "name") and not (k == "env" and envs)}
    own: dict[str, Any] = {"name": name, "data_dir": "${output_dir}/data"}
    if model == "tiny":  # built by prepare: under this experiment's output_dir
        own["model"] = {"name": "${output_dir}/models/tiny"}
    return base_name, {"defaults": [*defaults, "_self_"], **merge(merge(settings, own), body)}


def render_experiment(config: dict, base: str, command: str) -> str:
    head = (
        "# @package _global_\n"
        f"# Made by: {command}\n# The settings of conf/experiment/{base}.yaml (the root "
        "pipeline's), its own output_dir, data and model,\n# then the overrides given. Run by "
        f"experiments/{config['name']}/dvc.yaml, or by hand:\n#   asyncrl "
        f"<prepare|sft|rl|eval> experiment={config['name']}\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False)


IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # package.module:function, as env args name code


def env_packages(root: Path, cfg: Any) -> list[str]:
    """The folders under ``environments/`` holding code ``cfg``'s environments run: a verifiers taskset's
    package (its id, ``-`` as ``_``) and the top-level package of each ``package.module:function`` an
    environment's args name (an agent's agent, tasks, reward and demonstration)."""
    found = []
    for env in cfg.env.values():
        args = env.args or {}
        names = [
            v.split(".")[0].split(":")[0]
            for v in args.values()
            if isinstance(v, str) and IMPORT_PATH.fullmatch(v)
        ]
        if env.type == "verifiers" and args.get("taskset"):
            names.append(str(args["taskset"]).replace("-", "_"))
        for package in names:
            found += [str(p.parent.relative_to(root)) for p in (root / "environments").glob(f"*/{package}")]
    return sorted(set(found))


def pipeline(root: Path, name: str, packages: list[str]) -> dict:
    """The root ``dvc.yaml`` made this experiment's: run from the root, reading its params file."""
    params_file = f"experiments/{name}/params.yaml"
    root_stages = yaml.safe_load((root / "dvc.yaml").read_text())
    stages = {}
    for stage_name, stage in root_stages["stages"].items():
        inner = stage.get("do", stage)
        inner = {**inner, "cmd": _cmds(inner["cmd"])}
        if inner.get("params"):
            if "env" in inner["params"]:
                inner["deps"] = [*inner.get("deps", []), *packages]
            inner["params"] = [{"${P}": inner["params"]}]
        inner = {"wdir": "../..", **inner}
        stages[stage_name] = {**stage, "do": inner} if "do" in stage else inner
    plots = [
        {key: {**plot, "y": {f"../../{path}": cols for path, cols in plot["y"].items()}}}
        for item in root_stages.get("plots", [])
        for key, plot in item.items()
    ]
    return {
        "vars": ["params.yaml", {"P": params_file}],
        "stages": stages,
        **({"plots": plots} if plots else {}),
    }


def _cmds(cmd: str | list[str]) -> str | list[str]:
    def one(c: str) -> str:
        return c.replace("--config-file params.yaml", "--config-file ${P}")

    return one(cmd) if isinstance(cmd, str) else [one(c) for c in cmd]


def render_pipeline(spec: dict, name: str, command: str) -> str:
    head = (
        f"# Experiment {name}: the root pipeline's stages (prepare -> sft -> rl -> eval). Made by:\n#   "
        f"{command}\n# Run from the repository root: dvc repro experiments/{name}/dvc.yaml\n# params.yaml "
        f"here is the resolved `experiment={name}` (conf/experiment/{name}.yaml; `make relock`\n# rewrites "
        f"it): `asyncrl prepare --cfg experiment={name} > experiments/{name}/params.yaml`. Every stage\n"
        "# reads it with --config-file; top-level plot paths are relative to this "
        "file, not to the stages' wdir.\n"
    )
    return head + yaml.safe_dump(spec, sort_keys=False, width=120)


README = """# {name}

**Question.** (What does this experiment answer? One sentence a reader can check against the results.)

**Setup.** `conf/experiment/{name}.yaml`, made by `{command}`: {setup}. Run from the repository root:

    dvc repro experiments/{name}/dvc.yaml        # prepare -> sft -> rl -> eval; a second run reruns nothing
    dvc exp run experiments/{name}/dvc.yaml -S experiments/{name}/params.yaml:trainer.optim.lr=3e-4

`dvc exp run` needs this folder committed first (it runs in a copy of the last commit), and `-S` names this
folder's params file. By hand: `asyncrl <prepare|sft|rl|eval> experiment={name}`.

**Results.** (The eval metrics, `asyncrl compare outputs/{name}/eval_sft outputs/{name}/eval_rl`, and what
they say.)

| model | metric | value |
|---|---|---:|
"""


def write(
    root: Path, name: str, envs: list[str], overrides: list[str], force: bool, command: str
) -> list[Path]:
    """Check, then write the four files; the paths written."""
    from asyncrl.config import ConfigError  # lazy: Hydra is imported only for a real run
    from asyncrl.config.compose import compose_config, to_yaml  # lazy: as above

    if not NAME.match(name):
        raise Refused(f"experiment name {name!r}: lowercase letters, digits and _, starting with a letter")
    # conf/ may be a link (this repository's points into the package): the file's own path is the one git
    # adds
    folder, conf = root / "experiments" / name, (root / "conf").resolve() / "experiment" / f"{name}.yaml"
    if not force and (folder.exists() or conf.exists()):
        raise Refused(
            f"experiment {name!r} exists ({folder if folder.exists() else conf}); --force replaces it"
        )
    base, config = experiment_config(root, name, envs, overrides)
    previous = conf.read_text() if conf.exists() else None
    conf.write_text(render_experiment(config, base, command))
    try:
        cfg = compose_config([f"experiment={name}"], [root / "conf"])
    except ConfigError as e:
        if previous is None:
            conf.unlink()
        else:
            conf.write_text(previous)
        raise Refused(str(e)) from None
    folder.mkdir(parents=True, exist_ok=True)
    spec = pipeline(root, name, env_packages(root, cfg))
    setup = ", ".join([f"environments {', '.join(cfg.env)}", *overrides]) or "the root pipeline's settings"
    files = {
        folder / "params.yaml": to_yaml(cfg),
        folder / "dvc.yaml": render_pipeline(spec, name, command),
        folder / "README.md": README.format(name=name, command=command, setup=setup),
    }
    for path, text in files.items():
        path.write_text(text)
    return [conf, *files]


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl new", usage=USAGE, description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["experiment"])
    ap.add_argument("name")
    ap.add_argument(
        "--env", action="append", default=[], help="an environment of conf/env (repeat for a mixture)"
    )
    ap.add_argument("--force", action="store_true", help="replace an experiment of that name")
    args, overrides = ap.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        ap.error(f"unknown option {unknown[0]!r}")
    # what remakes the experiment on a clone, where nothing is there to replace
    command = " ".join(["asyncrl new", *(a for a in argv if a != "--force")])
    try:
        root = repo_root(Path.cwd())
        written = write(root, args.name, args.env, overrides, args.force, command)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(root) if path.is_relative_to(root) else path}")
    print(f"next: dvc repro experiments/{args.name}/dvc.yaml")
    return 0
