"""``asyncrl <command> [hydra overrides...]``: one entry point for every command.

This module imports neither torch nor Hydra: ``asyncrl --help`` answers instantly, and each command's
heavy module is imported only once its config has been composed and validated.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

COMMANDS = {
    "prepare": ("asyncrl.prepare", "generate task data and build the tiny default model"),
    "sft": ("asyncrl.trainer.sft", "supervised warmup (Fabric), writes <sft.run_dir>/model"),
    "rl": ("asyncrl.launcher.rl", "launch sidecar, orchestrator and trainer for an RL run"),
    "serve": ("asyncrl.inference.serve", "run the inference sidecar (OpenAI API + admin routes)"),
    "orchestrate": ("asyncrl.orchestrator.orchestrate", "run the orchestrator (rollouts, rewards, packing)"),
    "train": ("asyncrl.trainer.train", "run the RL trainer (Fabric)"),
    "eval": ("asyncrl.evals.eval", "evaluate a model on an environment's eval split"),
    "reconcile": (
        "asyncrl.launcher.reconcile",
        "check run_dir before `train`/`orchestrate` run on their own",
    ),
    "slurm": (
        "asyncrl.launcher.slurm",
        "render a SLURM batch script: one node, or N trainer + M inference nodes",
    ),
    "merge-lora": ("asyncrl.merge_lora", "merge a LoRA adapter into its base model: ADAPTER OUT [--base M]"),
    "compare": (
        "asyncrl.evals.compare",
        "eval metrics side by side: EVAL_DIR EVAL_DIR... (e.g. after SFT and RL)",
    ),
    "curves": (
        "asyncrl.monitor.curves",
        "metric curves of a run as CSV for `dvc plots`: METRICS_DIR OUT.csv KEY...",
    ),
    "new": ("asyncrl.launcher.new", "an experiment folder for `dvc repro`: experiment NAME [--env ENV]"),
}
# commands that read their own options (their module's ``cli(argv)``) instead of a composed config
OWN_OPTIONS = ("slurm", "merge-lora", "compare", "curves", "new")

USAGE = """usage: asyncrl <command> [key=value | group=option ...] [--config-dir DIR] [--config-file FILE]
                       [-m] [--cfg] [--help]

commands:
{commands}

Overrides are Hydra syntax: `asyncrl rl experiment=reverse_text trainer.optim.lr=3e-6`.
  --cfg               check what the command would (config, environments, paths, task data) and print
                      the resolved config; exits 2 with the error where the command would fail
  --config-dir DIR    also look for group options in DIR (your own env/*.yaml, experiment/*.yaml)
  --config-file FILE  start from a resolved config (e.g. <run_dir>/configs/config.yaml) instead of conf/
  -m, --multirun      a sweep: `asyncrl rl -m trainer.optim.lr=1e-4,3e-4 seed=0,1` runs every combination
                      (Hydra's syntax) one after another, each in <run_dir>/<i>_<key>-<value>..., then
                      prints a table (prepare, sft, rl, eval; with --cfg: check every run and list them, run
                      nothing);
                      inside experiments/NAME/: each combination queued as a DVC experiment of its pipeline
  --help              with a command: list every config key with its value and doc
"""


def _usage() -> str:
    return USAGE.format(commands="\n".join(f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()))


def _command_help(name: str, cfg) -> str:
    from asyncrl.config import describe

    rows = describe(cfg)
    width = max(len(k) for k, _, _ in rows)
    lines = [f"asyncrl {name}: {COMMANDS[name][1]}", "", "config keys (override with key=value):"]
    lines += [f"  {k:<{width}}  {v!r:<24} {doc}" for k, v, doc in rows]
    return "\n".join(lines)


def parse(argv: list[str]) -> dict[str, Any]:
    """Split ``argv`` into the command, Hydra overrides and our few flags."""
    out: dict[str, Any] = {
        "command": argv[0],
        "overrides": [],
        "config_file": None,
        "config_dirs": [],
        "cfg": False,
        "help": False,
        "multirun": False,
    }
    it = iter(argv[1:])
    for arg in it:
        name, _, value = arg.partition("=")
        if arg in ("-h", "--help"):
            out["help"] = True
        elif arg == "--cfg":
            out["cfg"] = True
        elif arg in ("-m", "--multirun"):
            out["multirun"] = True
        elif name in ("--config-file", "--config-dir"):
            path = value or next(it, None)
            if not path:
                raise SystemExit(f"error: {name} needs a path")
            if name == "--config-file":
                out["config_file"] = path
            else:
                out["config_dirs"].append(path)
        elif arg.startswith("-"):
            raise SystemExit(f"error: unknown option {arg!r}\n\n{_usage()}")
        else:
            out["overrides"].append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv[0] in OWN_OPTIONS:
        return int(importlib.import_module(COMMANDS[argv[0]][0]).cli(argv[1:]) or 0)
    args = parse(argv)
    if args["multirun"] and not args["help"]:
        return _sweep(args)

    from asyncrl.config import ConfigError
    from asyncrl.config.compose import load_config, to_yaml

    try:
        cfg = load_config(args["overrides"], args["config_file"], args["config_dirs"])
        if args["help"]:
            print(_command_help(args["command"], cfg))
            return 0
        from asyncrl.launcher.preflight import preflight

        # what the command needs from this machine, before anything starts; --cfg checks it without creating
        warnings = preflight(cfg, args["command"], create=not args["cfg"])
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args["cfg"]:
        print(to_yaml(cfg), end="")
        return 0
    from asyncrl import numerics

    # before the command's module, which imports torch: pinned kernels are chosen when torch loads
    numerics.apply(cfg.numerics, numerics.process_threads(cfg, args["command"]))
    module = importlib.import_module(COMMANDS[args["command"]][0])
    return int(module.main(cfg, args["overrides"]) or 0)


def _sweep(args: dict[str, Any]) -> int:
    """``-m``: every combination checked first, then run one after another (:mod:`asyncrl.launcher.sweep`),
    or, inside an experiment folder, queued as DVC experiments of its pipeline
    (:mod:`asyncrl.launcher.dvc_sweep`)."""
    from asyncrl.config import ConfigError
    from asyncrl.launcher import dvc_sweep, sweep

    try:
        if not args["config_file"] and (folder := dvc_sweep.experiment_folder(Path.cwd())):
            return dvc_sweep.queue(folder, args["overrides"], dry_run=args["cfg"])
        jobs = sweep.plan(args["command"], args["overrides"], args["config_file"], args["config_dirs"])
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args["cfg"]:
        for job in jobs:
            print(f"run {job.index}: asyncrl {args['command']} {' '.join(job.overrides)}")
        return 0
    flags = [f"--config-file={args['config_file']}"] if args["config_file"] else []
    return sweep.run(args["command"], jobs, flags + [f"--config-dir={d}" for d in args["config_dirs"]])


if __name__ == "__main__":
    sys.exit(main())
