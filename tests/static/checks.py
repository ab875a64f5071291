"""The container files' checks, written as functions that return problems (an empty list = fine).

No Docker engine runs in CI, so the Dockerfile, docker-compose.yml and devcontainer.json are checked
statically: by their own tools (hadolint, Docker Compose's loader, JSON schemas; see the test modules) and
by the functions here, which check what makes the pieces fit together: the targets that compose and the
devcontainer build exist, every container runs an `asyncrl` command whose config composes, and the three
RL processes agree on everything but their own settings. Each function is also run on deliberately broken
copies in the tests, so that none of them is a check that cannot fail.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the Dockerfile's targets: README, compose and the devcontainer use these
TARGETS = ("cpu", "dev", "gpu", "trainer")


def tool(name: str) -> str:
    """Path of a checker installed by the dev extra: next to this interpreter first, then on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: `make install` installs it (pyproject.toml's dev extra)")
    return found


def run(*argv: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


# -- JSONC (devcontainer.json) --------------------------------------------------------------------------

_JSONC_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/', re.DOTALL)


def load_jsonc(text: str):
    """JSON with // and /* */ comments, as devcontainer.json allows (and no trailing commas: its schema
    says allowTrailingCommas false). Strings are matched first, so a // inside one is kept."""
    return json.loads(_JSONC_TOKEN.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text))


# -- Dockerfile ----------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str | None
    base: str
    lines: list[tuple[str, str, int]] = field(default_factory=list)  # (INSTRUCTION, arguments, line number)


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages and their instructions: comments dropped, backslash continuations joined."""
    stages: list[Stage] = []
    logical, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if logical and line.startswith("#"):  # a comment inside a continued instruction
            continue
        start = start or number
        logical += " " + line[:-1] if line.endswith("\\") else " " + line
        if line.endswith("\\"):
            continue
        instruction, _, args = logical.strip().partition(" ")
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            stages.append(
                Stage(words[2] if len(words) >= 3 and words[1].lower() == "as" else None, words[0])
            )
        elif stages:
            stages[-1].lines.append((instruction, args, start))
        logical, start = "", 0
    return stages


def stage_chain(stages: list[Stage], name: str) -> list[Stage]:
    """``name`` and the stages it builds on (FROM <stage>), base first."""
    by_name = {s.name: s for s in stages if s.name}
    chain = [by_name[name]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def last(chain: list[Stage], instruction: str) -> str | None:
    values = [args for s in chain for ins, args, _ in s.lines if ins == instruction]
    return values[-1] if values else None


def dockerfile_problems(text: str) -> list[str]:
    stages = parse_dockerfile(text)
    names = {s.name for s in stages if s.name}
    problems = []
    for s in stages:
        if s.base in names:
            continue
        _, _, tag = s.base.partition("@")[0].rpartition(":")
        if not tag or "/" in tag or tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"FROM {s.base}: pin the base image by a version tag")
    for s in stages:
        for ins, args, line in s.lines:
            if ins == "RUN" and re.search(r"\b(pip|pip3|uv)\b[^;&|]*\b(install|wheel|sync)\b", args):
                problems.append(
                    f"line {line}: installs packages outside docker/install.sh (the one recipe that "
                    f"`make install` also runs): {args[:80]}"
                )
    for target in TARGETS:
        if target not in names:
            problems.append(f"no stage named {target!r} (docker build --target {target})")
            continue
        chain = stage_chain(stages, target)
        if last(chain, "ENTRYPOINT") != '["asyncrl"]':
            problems.append(f'target {target}: ENTRYPOINT is {last(chain, "ENTRYPOINT")}, not ["asyncrl"]')
        user = last(chain, "USER")
        if user is None or user.split(":")[0] in ("root", "0"):
            problems.append(f"target {target}: runs as root (USER {user}); end with the non-root user")
        runs = " ".join(args for s in chain for ins, args, _ in s.lines if ins == "RUN")
        if not re.search(rf"docker/install\.sh {target}\b", runs):
            problems.append(f"target {target}: never runs `docker/install.sh {target}`")
    return problems


def dockerfile_user(text: str, target: str) -> tuple[str, int] | None:
    """(name, uid) of the user that ``target`` creates with useradd."""
    runs = " ".join(
        a for s in stage_chain(parse_dockerfile(text), target) for i, a, _ in s.lines if i == "RUN"
    )
    m = re.search(r"useradd\b[^&;|]*?--uid (\d+)[^&;|]*?\s([a-z_][a-z0-9_-]*)\s*(?:&&|;|$)", runs)
    return (m.group(2), int(m.group(1))) if m else None


def dockerfile_env(text: str, target: str, key: str) -> str | None:
    """The last ``ENV key=value`` of ``target``'s chain, ${...} left as written."""
    value = None
    for s in stage_chain(parse_dockerfile(text), target):
        for ins, args, _ in s.lines:
            if ins == "ENV":
                for k, v in re.findall(r"(\w+)=(\S+)", args):
                    if k == key:
                        value = v
    return value


# -- docker-compose.yml ----------------------------------------------------------------------------------

# service -> the asyncrl command it must run; the GPU it reserves (host id, the file's defaults)
SERVICES = {
    "prepare": "prepare",
    "sft": "sft",
    "reconcile": "reconcile",
    "inference": "serve",
    "trainer": "train",
    "orchestrator": "orchestrate",
}
GPUS = {"sft": "1", "inference": "0", "trainer": "1"}
DONE = "service_completed_successfully"
DEPENDS = {
    "sft": [("prepare", DONE)],
    "inference": [("sft", DONE)],
    # the run directory is checked (and reconciled on resume) before either process reads it
    "trainer": [("sft", DONE), ("reconcile", DONE)],
    "orchestrator": [("inference", "service_healthy"), ("reconcile", DONE)],
}
# config keys that each RL process sets for itself; every other key must be the same in all three
PER_PROCESS = {
    "inference.backend",
    "inference.host",
    "inference.port",
    "inference.urls",
    "inference.admin_token",
    "trainer.fabric.accelerator",
    "trainer.fabric.precision",
    "trainer.fabric.num_threads",
}


def compose_model(path: Path, env: dict | None = None) -> dict:
    """The compose file as Docker Compose loads it (interpolated, anchors merged), or an AssertionError
    carrying Compose's own error. The environment is cleared of the file's variables, so the defaults
    written in the file are what is checked."""
    env = {
        k: v
        for k, v in (env or os.environ).items()
        if not k.startswith(("ASYNCRL_", "INFERENCE_GPU", "TRAINER_GPU", "COMPOSE_"))
    }
    proc = run(
        tool("docker-compose"),
        "--project-directory",
        str(path.parent),
        "-f",
        str(path),
        "config",
        "--format",
        "json",
        cwd=path.parent,
        env=env,
    )
    if proc.returncode != 0:
        raise AssertionError(f"docker compose config rejected {path.name}:\n{proc.stderr}")
    return json.loads(proc.stdout)


def service_argv(service: dict) -> list[str]:
    # `compose config` writes a literal $ as $$ (so that its output is itself a valid compose file);
    # the container receives a single $
    return [a.replace("$$", "$") for a in service.get("command") or []]


def _flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


@functools.lru_cache(maxsize=64)
def _compose_config(overrides: tuple[str, ...]):
    """A command's config (cached: the broken-copy tests change one service at a time; callers only read
    it)."""
    from asyncrl.config.compose import compose_config

    return compose_config(list(overrides))


def compose_problems(model: dict, dockerfile_text: str) -> list[str]:
    from asyncrl.cli import COMMANDS
    from asyncrl.config import ConfigError
    from asyncrl.config.compose import to_dict

    problems = []
    services = model.get("services", {})
    stages = {s.name for s in parse_dockerfile(dockerfile_text) if s.name}
    configs = {}
    for name, want in SERVICES.items():
        if name not in services:
            problems.append(f"no service {name!r} (runs `asyncrl {want}`)")
            continue
        svc = services[name]
        argv = service_argv(svc)
        if not argv or argv[0] != want:
            problems.append(f"{name}: runs `asyncrl {' '.join(argv[:1])}`, not `asyncrl {want}`")
        if argv and argv[0] not in COMMANDS:
            problems.append(f"{name}: `{argv[0]}` is not an asyncrl command ({', '.join(COMMANDS)})")
        if svc.get("entrypoint"):
            problems.append(f"{name}: overrides the image's entrypoint (asyncrl) with {svc['entrypoint']}")
        build = svc.get("build") or {}
        if build.get("target") not in stages:
            problems.append(
                f"{name}: builds target {build.get('target')!r}, which the Dockerfile does not define"
            )
        if (
            Path(build.get("context", "")).resolve() != REPO
            or build.get("dockerfile", "Dockerfile") != "Dockerfile"
        ):
            problems.append(f"{name}: build context must be the repository root and its Dockerfile")
        if not svc.get("init"):
            problems.append(
                f"{name}: needs init: true (as PID 1 the process ignores `compose down`'s SIGTERM)"
            )
        mounts = {
            v.get("target"): v.get("source") for v in svc.get("volumes", []) if v.get("type") == "volume"
        }
        if mounts.get("/runs") != "runs" or svc.get("working_dir") != "/runs":
            problems.append(
                f"{name}: must mount the volume `runs` at /runs and work there (shared relative paths)"
            )
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        ids = [i for d in devices for i in d.get("device_ids", [])]
        if ids != ([GPUS[name]] if name in GPUS else []):
            problems.append(
                f"{name}: reserves GPUs {ids}, expected {[GPUS[name]] if name in GPUS else 'none'}"
            )
        if devices and not all(
            d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices
        ):
            problems.append(f"{name}: a GPU reservation needs driver nvidia and capabilities [gpu]")
        for dep, condition in DEPENDS.get(name, []):
            got = svc.get("depends_on", {}).get(dep, {}).get("condition")
            if got != condition:
                problems.append(f"{name}: must depend on {dep} with condition {condition} (has {got})")
        if argv and argv[0] in COMMANDS:
            try:
                configs[name] = _compose_config(tuple(argv[1:]))
            except ConfigError as e:
                problems.append(f"{name}: `asyncrl {' '.join(argv)}` has an invalid config: {e}")
    if problems:
        return problems

    serve, orch, train, sft = (
        configs["inference"],
        configs["orchestrator"],
        configs["trainer"],
        configs["sft"],
    )
    if serve.inference.host != "0.0.0.0":
        problems.append(
            f"inference: binds {serve.inference.host}, unreachable from the other containers (0.0.0.0)"
        )
    if serve.inference.backend != "vllm":
        problems.append(f"inference: backend {serve.inference.backend!r} on a GPU container (vllm)")
    if orch.inference.urls != [f"http://inference:{serve.inference.port}"]:
        problems.append(
            f"orchestrator: inference.urls={orch.inference.urls}, but the sidecar is "
            f"http://inference:{serve.inference.port}"
        )
    if not serve.inference.admin_token or orch.inference.admin_token != serve.inference.admin_token:
        problems.append(
            "inference and orchestrator need the same non-empty inference.admin_token: the "
            "orchestrator calls /update_weights from another container, not from loopback"
        )
    health = " ".join(services["inference"].get("healthcheck", {}).get("test", []))
    if f":{serve.inference.port}/health" not in health:
        problems.append(
            f"inference: the healthcheck must poll /health on port {serve.inference.port}: {health!r}"
        )
    for name in ("sft", "trainer"):
        if configs[name].trainer.fabric.accelerator != "cuda":
            problems.append(
                f"{name}: trainer.fabric.accelerator={configs[name].trainer.fabric.accelerator} on a GPU"
            )
    sft_model = f"{sft.sft.run_dir}/model"
    for name in ("inference", "trainer", "orchestrator"):
        if configs[name].model.name != sft_model:
            problems.append(f"{name}: model.name={configs[name].model.name}, not the SFT output {sft_model}")
    flat = {name: _flatten(to_dict(configs[name])) for name in ("inference", "trainer", "orchestrator")}
    for key in sorted(set().union(*flat.values()) - PER_PROCESS):
        values = {name: f.get(key) for name, f in flat.items()}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            problems.append(f"the RL processes disagree on {key}: {values}")
    # reconcile prepares the directory the trainer and orchestrator use, for the resume they make
    for key in ("run_dir", "ckpt.resume", "max_steps", "async_level", "launcher.overwrite"):
        if (got := _flatten(to_dict(configs["reconcile"])).get(key)) != flat["trainer"].get(key):
            problems.append(
                f"reconcile: {key}={got!r} but the RL processes use {flat['trainer'].get(key)!r}"
            )
    if to_dict(configs["prepare"])["model"] != to_dict(sft)["model"]:
        problems.append(
            f"sft: model {sft.model.name} differs from the one `prepare` builds "
            f"({configs['prepare'].model.name})"
        )
    for name in ("prepare", "sft"):
        for key in ("data_dir", "seed"):
            if getattr(configs[name], key) != getattr(train, key):
                problems.append(
                    f"{name}: {key}={getattr(configs[name], key)!r} but the RL "
                    f"processes use {getattr(train, key)!r}"
                )
        if to_dict(configs[name])["env"] != to_dict(train)["env"]:
            problems.append(f"{name}: env differs from the RL processes' env")
    return problems


# -- devcontainer.json ---------------------------------------------------------------------------------


def devcontainer_problems(config: dict, config_path: Path, dockerfile_text: str) -> list[str]:
    problems = []
    here = config_path.parent
    build = config.get("build", {})
    if (here / build.get("dockerfile", "")).resolve() != REPO / "Dockerfile":
        problems.append(f"build.dockerfile={build.get('dockerfile')!r} is not the repository's Dockerfile")
    if (here / build.get("context", ".")).resolve() != REPO:
        problems.append(f"build.context={build.get('context')!r} is not the repository root")
    stages = {s.name for s in parse_dockerfile(dockerfile_text) if s.name}
    if build.get("target") != "dev" or "dev" not in stages:
        problems.append(
            f"build.target={build.get('target')!r}: the devcontainer builds the Dockerfile's dev target"
        )
    gpu = config.get("hostRequirements", {}).get("gpu")
    if gpu not in (True, "optional") and not any(a.startswith("--gpus") for a in config.get("runArgs", [])):
        problems.append(
            "no GPU access: set hostRequirements.gpu ('optional' adds --gpus all where there is one)"
        )
    post = config.get("postCreateCommand", "")
    post = " ".join(post) if isinstance(post, list) else post
    script = REPO / "docker" / "install.sh"
    if not re.search(r"docker/install\.sh dev\b", post):
        problems.append(
            f"postCreateCommand {post!r} does not run `docker/install.sh dev` (the image's recipe)"
        )
    if not os.access(script, os.X_OK):
        problems.append(f"{script} is not executable")
    user = dockerfile_user(dockerfile_text, "dev") if "dev" in stages else None
    runs_as = (
        last(stage_chain(parse_dockerfile(dockerfile_text), "dev"), "USER") if "dev" in stages else None
    )
    if user is None or config.get("remoteUser") != user[0] or (runs_as or "").split(":")[0] != str(user[1]):
        problems.append(
            f"remoteUser={config.get('remoteUser')!r}, but the dev image's user is "
            f"{user} and it runs as USER {runs_as}"
        )
    venv = dockerfile_env(dockerfile_text, "dev", "VIRTUAL_ENV") if "dev" in stages else None
    interpreter = (
        config.get("customizations", {})
        .get("vscode", {})
        .get("settings", {})
        .get("python.defaultInterpreterPath")
    )
    if interpreter and (not venv or not interpreter.startswith(venv + "/")):
        problems.append(
            f"python.defaultInterpreterPath={interpreter} is outside the dev image's venv {venv}"
        )
    return problems
