"""docker-compose.yml: the compose-spec schema, Docker Compose's own loader, and an RL run that fits
together."""

from __future__ import annotations

import copy

import pytest

from .checks import REPO, compose_model, compose_problems, run, tool

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = (REPO / "Dockerfile").read_text()


def check_schema(path):
    # check-jsonschema's copy of the compose-spec schema (vendor.compose-spec): nothing is fetched
    return run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))


def test_compose_file_matches_the_compose_spec_schema():
    proc = check_schema(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_fails_on_a_broken_copy(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: service_ready"))
    proc = check_schema(broken)
    assert proc.returncode != 0 and "service_ready" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def model():
    return compose_model(COMPOSE)


def test_docker_compose_loads_it(model):
    assert set(model["services"]) >= {"inference", "trainer", "orchestrator"}


def test_docker_compose_rejects_a_broken_copy(tmp_path):
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE.read_text().replace(
            "      inference:\n        condition: service_healthy",
            "      vllm:\n        condition: service_healthy",
        )
    )
    with pytest.raises(AssertionError, match='depends on undefined service "vllm"'):
        compose_model(broken)


def test_the_containers_make_one_rl_run(model):
    """Commands are asyncrl commands whose configs compose; GPUs, ordering, URL, token and volume fit."""
    assert compose_problems(model, DOCKERFILE) == []


def _set_arg(service: dict, key: str, value: str) -> None:
    service["command"] = [a for a in service["command"] if not a.startswith(key + "=")] + [f"{key}={value}"]


BREAKAGES = {
    "unknown command": (
        lambda m: m["services"]["orchestrator"]["command"].__setitem__(0, "orchestrator"),
        "not an asyncrl command",
    ),
    "invalid override": (
        lambda m: _set_arg(m["services"]["trainer"], "trainer.optim.lr", "-1"),
        "has an invalid config",
    ),
    "sidecar on loopback": (
        lambda m: _set_arg(m["services"]["inference"], "inference.host", "127.0.0.1"),
        "unreachable from the other containers",
    ),
    "wrong sidecar port": (
        lambda m: _set_arg(m["services"]["orchestrator"], "inference.urls", "[http://inference:9000]"),
        "inference.urls=",
    ),
    "no shared token": (
        lambda m: _set_arg(m["services"]["orchestrator"], "inference.admin_token", "other"),
        "same non-empty inference.admin_token",
    ),
    "processes disagree": (
        lambda m: _set_arg(m["services"]["trainer"], "seq_len", "256"),
        "disagree on seq_len",
    ),
    "sft of another model": (
        lambda m: _set_arg(m["services"]["sft"], "model", "tiny"),
        "differs from the one `prepare` builds",
    ),
    "base model served": (
        lambda m: _set_arg(m["services"]["inference"], "model.name", "outputs/models/gpu_small"),
        "not the SFT output",
    ),
    "same GPU": (
        lambda m: m["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"][0].__setitem__(
            "device_ids", ["0"]
        ),
        "trainer: reserves GPUs ['0']",
    ),
    "not waiting for health": (
        lambda m: m["services"]["orchestrator"]["depends_on"]["inference"].__setitem__(
            "condition", "service_started"
        ),
        "condition service_healthy",
    ),
    "trainer before reconcile": (
        lambda m: m["services"]["trainer"]["depends_on"].pop("reconcile"),
        "trainer: must depend on reconcile",
    ),
    "reconcile of another run": (
        lambda m: _set_arg(m["services"]["reconcile"], "run_dir", "elsewhere"),
        "reconcile: run_dir",
    ),
    "missing target": (
        lambda m: m["services"]["trainer"]["build"].__setitem__("target", "cuda"),
        "which the Dockerfile does not define",
    ),
    "no init": (lambda m: m["services"]["trainer"].pop("init"), "needs init: true"),
    "no shared volume": (
        lambda m: m["services"]["orchestrator"].__setitem__("volumes", []),
        "volume `runs`",
    ),
    "healthcheck elsewhere": (
        lambda m: m["services"]["inference"]["healthcheck"].__setitem__("test", ["CMD", "true"]),
        "healthcheck must poll /health",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_compose_checks_fail_on_broken_copies(model, breakage):
    broken = copy.deepcopy(model)
    mutate, problem = BREAKAGES[breakage]
    mutate(broken)
    problems = compose_problems(broken, DOCKERFILE)
    assert any(problem in p for p in problems), problems
