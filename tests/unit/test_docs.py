"""The documentation: the generated configuration reference is current, the README stays short, every
relative link resolves, no page names a commit or an internal work item, and the "your own task" example
runs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from asyncrl.config import reference
from helpers.launch import asyncrl

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a Markdown link or image target: [text](target) or [text](target "title")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a commit hash (7 to 40 hex digits) or an internal work-item number
HISTORY = re.compile(r"\b[0-9a-f]{7,40}\b|[Ii]ssue [0-9]+")


def test_configuration_reference_is_current():
    committed = (ROOT / reference.PAGE).read_text()
    assert committed == reference.render(), (
        f"{reference.PAGE} is stale: regenerate it with `{reference.COMMAND}` (or `make "
        "docs`) from the repository root"
    )


def test_reference_lists_every_key():
    page = reference.render()
    for key in (
        "trainer.optim.lr",
        "orchestrator.group_size",
        "async_level",
        "env.<name>.args",
        "model.lora.r",
    ):
        assert f"`{key}`" in page, key


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail to docs/ (at most 200)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_commit_hashes_or_work_items(page):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)} names commits or work items: {found}"


def test_the_results_index_lists_every_result():
    """benchmarks/results/README.md is how a figure's file is found: each dated page is linked from it, each
    result file is named in it."""
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    missing = [
        f.name
        for f in sorted(results.iterdir())
        if f.is_file() and f.name != "README.md"
        and (f"]({f.name})" if f.suffix == ".md" else f"`{f.name}`") not in index
    ]  # fmt: skip
    assert not missing, f"benchmarks/results/README.md does not list: {missing} (add them to its tables)"


def _block(text: str, first_line: str, lang: str) -> str:
    """The fenced ``lang`` block of ``text`` whose first line is ``first_line``, without that line."""
    match = re.search(rf"```{lang}\n{re.escape(first_line)}\n(.*?)```", text, re.S)
    assert match, f"docs/your-own-task.md has no ```{lang} block starting with {first_line!r}"
    return match.group(1)


def test_your_own_task_example_prepares(tmp_path):
    """docs/your-own-task.md's package, env yaml and experiment file, verbatim, through `asyncrl prepare`:
    the eval split differs from train, and the seed changes the data."""
    page = (ROOT / "docs" / "your-own-task.md").read_text()
    files = {
        "sortletters/env.py": "python",
        "myconf/env/sort_letters.yaml": "yaml",
        "myconf/experiment/sort_letters.yaml": "yaml",
    }
    for name, lang in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(_block(page, f"# {name}", lang))
    (tmp_path / "sortletters" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def prepare(seed: int) -> Path:
        out = tmp_path / f"data{seed}"
        args = [
            "--config-dir",
            "myconf",
            "experiment=sort_letters",
            f"data_dir={out}",
            "model.init.build=false",
        ]
        asyncrl("prepare", *args, f"seed={seed}", cwd=tmp_path, env=env, timeout=120, check=True)
        return out / "sort_letters"

    data = prepare(0)
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    assert train and held_out
    assert not {r["text"] for r in train} & {r["text"] for r in held_out}, (
        "eval texts must not appear in train"
    )
    assert (prepare(1) / "train.jsonl").read_text() != (data / "train.jsonl").read_text(), (
        "the seed changes the data"
    )
