"""``asyncrl <command> [hydra overrides...]``: one entry point, seven commands.

This module imports neither torch nor Hydra: ``asyncrl --help`` answers instantly, and each command's
heavy module is imported only once its config has been composed and validated.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "prepare": ("asyncrl.prepare", "generate task data and build the tiny default model"),
    "sft": ("asyncrl.trainer.sft", "supervised warmup (Fabric), writes <sft.run_dir>/model"),
    "rl": ("asyncrl.launcher.rl", "launch sidecar, orchestrator and trainer for an RL run"),
    "serve": ("asyncrl.inference.main", "run the inference sidecar (OpenAI API + admin routes)"),
    "orchestrate": ("asyncrl.orchestrator.main", "run the orchestrator (rollouts, rewards, packing)"),
    "train": ("asyncrl.trainer.rl", "run the RL trainer (Fabric)"),
    "eval": ("asyncrl.evals.main", "evaluate a model on an environment's eval split"),
}

USAGE = """usage: asyncrl <command> [key=value | group=option ...] [--config-file FILE] [--cfg] [--help]

commands:
{commands}

Overrides are Hydra syntax: `asyncrl rl experiment=reverse_text trainer.optim.lr=3e-6`.
  --cfg               print the resolved config and exit
  --config-file FILE  start from a resolved config (e.g. <run_dir>/configs/config.yaml) instead of conf/
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


def parse(argv: list[str]) -> tuple[str, list[str], str | None, bool, bool]:
    command, rest = argv[0], argv[1:]
    overrides, config_file, show_cfg, show_help = [], None, False, False
    it = iter(rest)
    for arg in it:
        if arg in ("-h", "--help"):
            show_help = True
        elif arg == "--cfg":
            show_cfg = True
        elif arg == "--config-file":
            config_file = next(it, None)
            if config_file is None:
                raise SystemExit("error: --config-file needs a path")
        elif arg.startswith("--config-file="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise SystemExit(f"error: unknown option {arg!r}\n\n{_usage()}")
        else:
            overrides.append(arg)
    return command, overrides, config_file, show_cfg, show_help


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    command, overrides, config_file, show_cfg, show_help = parse(argv)

    from asyncrl.config import ConfigError
    from asyncrl.config.compose import load_config, to_yaml

    try:
        cfg = load_config(overrides, config_file)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if show_help:
        print(_command_help(command, cfg))
        return 0
    if show_cfg:
        print(to_yaml(cfg), end="")
        return 0
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(cfg, overrides) or 0)


if __name__ == "__main__":
    sys.exit(main())
