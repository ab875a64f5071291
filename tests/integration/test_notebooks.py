"""The notebooks in notebooks/: committed without outputs, and executed end to end on real fixtures.

- run_overview.ipynb runs on a 3-step `asyncrl rl` run of the micro model (from the shared SFT setup);
- compare_experiments.ipynb runs on a throwaway DVC repository with two real `dvc exp run`s, so it does
  not depend on this repository's own pipeline;
- both run once more through the command the docs give (`jupyter execute notebooks/<name>.ipynb`, the
  executed copy written to outputs/notebooks/), from the repository root with the venv's `jupyter` (its own
  interpreter's kernel), as on a fresh clone.

The kernel is this interpreter (a kernelspec written to a temporary JUPYTER_PATH, which Jupyter searches
first), so the notebooks import the asyncrl under test whatever kernels the machine has. Figures use
matplotlib's inline backend: Agg rendering into PNG outputs, no window.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.launch import asyncrl, rl_args
from helpers.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
EXPECTED = {"run_overview.ipynb", "compare_experiments.ipynb"}
# the command docs/ give to run a notebook headless: the executed copy, outputs kept, lands in
# outputs/notebooks/ (the committed notebook stays without outputs; nbclient writes relative to the
# notebook's folder)
DOCUMENTED = (
    "mkdir -p outputs/notebooks && jupyter execute notebooks/{name} --output=../outputs/notebooks/{stem}"
)


# -- outputs stripped ------------------------------------------------------------------------------------


def saved_state(nb: dict) -> list[str]:
    """What a notebook carries from having been run: outputs, execution counts, execution timings."""
    problems = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i}: {len(cell['outputs'])} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i}: execution_count {cell['execution_count']}")
        if "execution" in cell.get("metadata", {}):
            problems.append(f"cell {i}: execution timings in metadata")
    if "widgets" in nb.get("metadata", {}):
        problems.append("notebook metadata: widget state")
    return problems


def test_the_notebooks_are_there():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} >= EXPECTED


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_saved_without_outputs(path):
    problems = saved_state(json.loads(path.read_text()))
    assert not problems, (
        f"{path.relative_to(ROOT)} was saved after running: {problems}. Clear it before "
        "committing: in Jupyter, Edit > Clear Outputs of All Cells, then save; or `nbstripout "
        "notebooks/*.ipynb` (`nbstripout --install` does it on every commit)"
    )


def test_saved_state_finds_outputs_counts_and_timings():
    import nbformat

    nb = nbformat.read(NOTEBOOKS / "run_overview.ipynb", as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert saved_state(nb) == [] and len(code) >= 3
    nb.cells[code[0]].outputs = [nbformat.v4.new_output("stream", text="hi")]
    nb.cells[code[1]].execution_count = 3
    nb.cells[code[2]].metadata["execution"] = {"iopub.execute_input": "2026-11-22T00:00:00Z"}
    assert saved_state(nb) == [
        f"cell {code[0]}: 1 output(s)",
        f"cell {code[1]}: execution_count 3",
        f"cell {code[2]}: execution timings in metadata",
    ]


# -- executed
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory) -> dict[str, str]:
    """Environment for the kernel and the Jupyter lookups: this interpreter's kernelspec as `python3`."""
    from ipykernel.kernelspec import write_kernel_spec

    jupyter_path = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(jupyter_path / "kernels" / "python3")
    return {
        "JUPYTER_PATH": str(jupyter_path),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "DVC_NO_ANALYTICS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def execute(name: str, env: dict[str, str], monkeypatch) -> list:
    """Run notebooks/<name> from notebooks/ (as Jupyter does) and return its code cells, outputs filled in.
    A last cell, added here only, reports the kernel's interpreter."""
    import nbformat
    from nbclient import NotebookClient

    for key, value in env.items():
        monkeypatch.setenv(key, value)  # JUPYTER_PATH is read here, the rest by the kernel
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable, end='')"))
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute(env=dict(os.environ))
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert cells[-1].outputs[0]["text"] == sys.executable, "the kernel is not this interpreter"
    return cells[:-1]


def html(cell) -> str:
    return "".join(o["data"].get("text/html", "") for o in cell.outputs if "data" in o)


def images(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.outputs)


def cell_with(cells: list, source: str):
    (cell,) = [c for c in cells if source in c.source]
    return cell


@pytest.fixture(scope="module")
def fixture_run(setup, tmp_path_factory) -> Path:
    """3 steps of `asyncrl rl` from the SFT-warmed micro model, 4 prompts x 4 samples (the notebook needs
    every file of a run directory, not a learning signal)."""
    run = tmp_path_factory.mktemp("nb_run") / "rl"
    proc = asyncrl(
        "rl",
        *rl_args(setup, run, "max_steps=3", "orchestrator.prompts_per_step=4", "orchestrator.group_size=4"),
    )
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.slow
def test_run_overview_notebook(fixture_run, kernel_env, monkeypatch):
    cells = execute("run_overview.ipynb", {**kernel_env, "ASYNCRL_RUN_DIR": str(fixture_run)}, monkeypatch)
    assert str(fixture_run) in html(cell_with(cells, "runs.run_info(RUN_DIR)"))
    assert images(cell_with(cells, "plot_run_curves")) == 1
    curves = html(cell_with(cells, "curve_columns"))
    assert all(
        k in curves for k in ("rollout/reward_mean", "train/loss", "train/mismatch_kl", "async/staleness")
    )
    # the browser shows, for every step, the best and the worst completion as the samples files say
    browser = html(cell_with(cells, "best_and_worst"))
    for step in range(3):
        rows = read_jsonl(fixture_run / "samples" / f"step_{step}.jsonl")
        assert len(rows) == 16
        best, worst = max(rows, key=lambda r: r["reward"]), min(rows, key=lambda r: r["reward"])
        for rank, row in (("best", best), ("worst", worst)):
            assert (
                f"<td>{rank}</td>\n      <td>{row['prompt']}</td>\n      <td>{row['completion']}</td>"
                in browser
            ), (
                step,
                rank,
                row,
            )
    assert browser.count("<td>best</td>") == browser.count("<td>worst</td>") == 3 * 2  # TOP_K = 2
    full = "".join(o.get("text", "") for o in cell_with(cells, "full text").outputs)
    assert full.count("--- step 2 ") == 4


@pytest.mark.slow
def test_run_overview_names_a_missing_run_dir(kernel_env, monkeypatch, tmp_path):
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match=f"run directory not found: {tmp_path / 'nope'}"):
        execute("run_overview.ipynb", {**kernel_env, "ASYNCRL_RUN_DIR": str(tmp_path / "nope")}, monkeypatch)


def dvc(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
    )
    assert proc.returncode == 0, f"dvc {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> Path:
    """A git + DVC repository with one stage (a Python one-liner: metrics.json from params.yaml), its
    baseline committed, and two experiments: lr 0.3 (auto-named) and lr 0.5 (named big-lr)."""
    repo = tmp_path_factory.mktemp("dvc_repo")
    for cmd in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "test"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    (repo / "params.yaml").write_text(yaml.safe_dump({"train": {"lr": 0.1, "epochs": 2}, "seed": 0}))
    score = (
        "import json, yaml; p = yaml.safe_load(open('params.yaml'))['train']; "
        "json.dump({'eval': {'reward': round(1 - p['lr'], 3)}, 'epochs_seen': p['epochs']}, "
        "open('metrics.json', 'w'))"
    )
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "score": {
                        "cmd": f"{shlex.quote(sys.executable)} -c {shlex.quote(score)}",
                        "params": ["train.lr", "train.epochs"],
                        "metrics": [{"metrics.json": {"cache": False}}],
                    }
                }
            }
        )
    )
    dvc(repo, "repro", "-q")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "baseline"], cwd=repo, check=True)
    dvc(repo, "exp", "run", "-q", "-S", "train.lr=0.3")
    dvc(repo, "exp", "run", "-q", "-S", "train.lr=0.5", "-n", "big-lr")
    return repo


@pytest.mark.slow
def test_compare_experiments_notebook(dvc_repo, kernel_env, monkeypatch):
    cells = execute(
        "compare_experiments.ipynb",
        {**kernel_env, "ASYNCRL_DVC_REPO": str(dvc_repo), "ASYNCRL_METRIC": "eval.reward"},
        monkeypatch,
    )
    table = html(cell_with(cells, "experiments_table"))
    assert "big-lr" in table and "train.lr" in table and "eval.reward" in table
    assert "train.epochs" not in table  # the same in every experiment: only changed params are shown
    for lr, reward in ((0.1, 0.9), (0.3, 0.7), (0.5, 0.5)):
        assert f"<td>{lr}</td>" in table and f"<td>{reward}</td>" in table
    assert images(cell_with(cells, "plot_metric_vs_param")) == 1
    ranking = html(cell_with(cells, "best first"))
    # PARAM defaulted to the one param that changed; rows best first on eval.reward
    assert ranking.index("<td>0.9</td>") < ranking.index("<td>0.7</td>") < ranking.index("<td>0.5</td>")
    assert "no failed experiment" in cell_with(cells, "failed").outputs[0]["data"]["text/plain"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_documented_command_runs_each_notebook(name, request):
    """The docs' command, word for word, from the repository root: nothing but `jupyter execute` (nbclient),
    no nbconvert; the parameters come from the environment as a user would pass them."""
    if name == "run_overview.ipynb":
        params = {"ASYNCRL_RUN_DIR": str(request.getfixturevalue("fixture_run"))}
    else:
        params = {
            "ASYNCRL_DVC_REPO": str(request.getfixturevalue("dvc_repo")),
            "ASYNCRL_METRIC": "eval.reward",
        }
    bin_dir = str(Path(sys.executable).parent)  # the venv's bin/, first on PATH as after activating it
    env = {**os.environ, **params, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MPLBACKEND": "Agg"}
    env.pop("JUPYTER_PATH", None)
    executed = ROOT / "outputs" / "notebooks" / name
    executed.unlink(missing_ok=True)
    command = DOCUMENTED.format(name=name, stem=Path(name).stem)
    proc = subprocess.run(
        command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{command}: {proc.stdout}\n{proc.stderr}"
    # the committed notebook is left as it was
    assert not saved_state(json.loads((NOTEBOOKS / name).read_text()))
    assert saved_state(json.loads(executed.read_text()))  # and the executed copy keeps what the run showed
