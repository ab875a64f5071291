"""The interpreters `asyncrl rl` starts its processes from (launcher.trainer_python,
launcher.inference_python) are asked, before anything starts, for what the config needs of each process; real
interpreters stand in for them."""

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.launcher import environments, rl
from asyncrl.launcher.environments import environment_problems, needs
from asyncrl.launcher.preflight import preflight
from asyncrl.utils import forked

VLLM_PYTHON = "/opt/vllm/bin/python"  # another environment's interpreter (vLLM's)


def bare_venv(path: Path) -> Path:
    """A virtual environment of the interpreter that runs the tests' base Python, without asyncrl or
    torch."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, env={"PATH": ""})
    return path / "bin" / "python"


def test_what_each_process_needs():
    assert needs(compose_config([]), "trainer") == {"torch": "the trainer"}
    assert needs(compose_config([]), "inference") == {}
    fa4 = needs(compose_config(["model.attn_implementation=varlen_fa4"]), "trainer")
    assert fa4["flash-attn-4"] == "model.attn_implementation=varlen_fa4"
    assert "vllm" in needs(compose_config(["inference.backend=vllm"]), "inference")
    nccl = needs(compose_config(["layout=2gpu", "weights.transport=nccl"]), "trainer")
    assert nccl["vllm"].startswith("weights.transport=nccl")
    assert "vllm" not in needs(compose_config(["layout=2gpu", "weights.transport=filesystem"]), "trainer")


def test_an_environment_without_asyncrl_or_torch_is_refused_by_key(tmp_path):
    python = bare_venv(tmp_path / "venv")
    cfg = compose_config([f"launcher.trainer_python={python}"])
    (problem, lacks) = environment_problems(cfg, "rl")
    assert problem.startswith(f"launcher.trainer_python={python} has no asyncrl")
    assert lacks == f"launcher.trainer_python={python} lacks what the trainer needs: torch (the trainer)"
    with pytest.raises(ConfigError, match="launcher.trainer_python"):
        preflight(cfg, "rl", create=False)


def test_an_environment_with_another_asyncrl_is_refused(tmp_path):
    python = bare_venv(tmp_path / "venv")
    other = tmp_path / "other" / "asyncrl"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    (site / "other.pth").write_text(str(other.parent) + "\n")
    (problem,) = environment_problems(compose_config([f"launcher.inference_python={python}"]), "rl")
    assert f"imports asyncrl from {other}, the launcher from" in problem


def test_this_checkouts_environment_by_another_name_passes_and_a_missing_one_is_named(tmp_path):
    # the same environment by another of its names: asked as another interpreter is, in a process of its own
    other_name = next(
        p for p in Path(sys.executable).parent.glob("python3*") if p.name != Path(sys.executable).name
    )
    assert environment_problems(compose_config([f"launcher.trainer_python={other_name}"]), "rl") == []
    environments.report.cache_clear()
    (problem,) = environment_problems(compose_config([f"launcher.trainer_python={tmp_path / 'nope'}"]), "rl")
    assert problem.startswith(f"launcher.trainer_python={tmp_path / 'nope'}: cannot run it")


def test_a_command_checks_its_own_interpreter():
    cfg = compose_config(["inference.backend=vllm"])
    problems = environment_problems(cfg, "serve")
    have_vllm = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0
    assert problems == ([] if have_vllm else [f"{sys.executable} lacks what the inference needs: vllm "
                                                "(inference.backend=vllm)"])  # fmt: skip
    assert environment_problems(cfg, "orchestrate") == []  # the orchestrator needs nothing of the two


def test_the_launcher_starts_the_trainer_and_the_sidecars_from_their_interpreters(tmp_path, monkeypatch):
    from asyncrl.paths import RunDir

    started, forks = {}, {}

    def spawn(name, argv, log, env=None, fork=False):
        forks[name], started[name] = fork, argv

    monkeypatch.setattr(rl, "spawn", spawn)
    cfg = compose_config(["launcher.trainer_python=/opt/trainer/bin/python", f"run_dir={tmp_path}/run"])
    rl.start_workers(cfg, tmp_path / "config.yaml", RunDir(tmp_path / "run"), None, [])
    assert started["trainer"][:3] == ["/opt/trainer/bin/python", "-m", "asyncrl"]
    assert started["orchestrator"][0] == sys.executable
    # another interpreter starts fresh; the launcher's own CPU processes are forks of it
    # (asyncrl/utils/forked.py)
    assert forks == {"orchestrator": True, "trainer": False}
    assert forked.forks(compose_config([])) == {"inference": True, "trainer": True, "orchestrator": True}
    assert forked.forks(compose_config(["launcher.preload=false"])) == dict.fromkeys(
        forks | {"inference": 0}, False
    )
    gpu = compose_config(["inference.backend=vllm", "trainer.fabric.accelerator=cuda"])
    assert forked.forks(gpu) == {"inference": False, "trainer": False, "orchestrator": True}
    cfg.launcher.inference_python = VLLM_PYTHON
    assert rl.sidecar_argv(cfg, tmp_path / "config.yaml", "inference", 8000)[0] == VLLM_PYTHON


@pytest.mark.parametrize(
    "overrides,python,fork",
    [
        ([], sys.executable, True),
        (["launcher.preload=false"], sys.executable, False),
        ([f"launcher.inference_python={VLLM_PYTHON}"], VLLM_PYTHON, False),
    ],
)
def test_an_evals_builtin_sidecar_is_a_fork_of_it(tmp_path, monkeypatch, overrides, python, fork):
    """As the launcher's, the eval's built-in sidecar is a fork of it once it imported torch and
    transformers; another interpreter's, or with preload off, starts fresh."""
    from asyncrl.evals import eval as evaluation

    calls = []
    monkeypatch.setattr(evaluation, "spawn", lambda *a, fork=False: calls.append((a[1], fork)))
    monkeypatch.setattr(forked, "preload", lambda: calls.append("preload"))
    evaluation.start_sidecar(compose_config(overrides), tmp_path)
    assert calls[-1][0][:4] == [python, "-m", "asyncrl", "serve"] and calls[-1][1] is fork
    assert ("preload" in calls) is fork
