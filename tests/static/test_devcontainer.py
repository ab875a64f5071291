"""devcontainer/devcontainer.json: found without flags through `.devcontainer`, valid, and on the dev
target."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from .checks import REPO, devcontainer_problems, load_jsonc, run

CONFIG = REPO / ".devcontainer" / "devcontainer.json"  # the path VS Code and the devcontainer CLI look at
DOCKERFILE = (REPO / "Dockerfile").read_text()
# The official schema (devcontainers/spec, schemas/devContainer.base.schema.json) ships in no PyPI or npm
# package; it is used from here, or from $DEVCONTAINER_SCHEMA, when present.
SCHEMA = Path(
    os.environ.get("DEVCONTAINER_SCHEMA")
    or Path(__file__).parent / "schemas" / "devContainer.base.schema.json"
)


def test_found_through_the_dot_devcontainer_link():
    link = REPO / ".devcontainer"
    assert link.is_symlink() and link.resolve() == REPO / "devcontainer", (
        "`.devcontainer` must link to devcontainer/"
    )
    assert CONFIG.is_file()


def test_jsonc_loader_keeps_strings_and_drops_comments():
    assert load_jsonc('{"a": "x // y /* z */", // c\n /* d */ "b": [1]}') == {
        "a": "x // y /* z */",
        "b": [1],
    }
    with pytest.raises(json.JSONDecodeError):  # trailing commas: the schema says allowTrailingCommas false
        load_jsonc('{"a": 1,}')


def test_points_at_the_dev_target_with_gpus_and_the_install_script():
    assert devcontainer_problems(load_jsonc(CONFIG.read_text()), CONFIG, DOCKERFILE) == []


@pytest.mark.parametrize(
    "key, value, problem",
    [
        (
            "build",
            {"dockerfile": "Dockerfile", "context": "..", "target": "dev"},
            "not the repository's Dockerfile",
        ),
        (
            "build",
            {"dockerfile": "../Dockerfile", "context": ".", "target": "dev"},
            "not the repository root",
        ),
        (
            "build",
            {"dockerfile": "../Dockerfile", "context": "..", "target": "gpu"},
            "builds the Dockerfile's dev target",
        ),
        ("hostRequirements", {}, "no GPU access"),
        ("postCreateCommand", "pip install -e .", "does not run `docker/install.sh dev`"),
        ("remoteUser", "vscode", "the dev image's user is"),
    ],
)
def test_devcontainer_checks_fail_on_broken_copies(key, value, problem):
    config = load_jsonc(CONFIG.read_text())
    config[key] = value
    problems = devcontainer_problems(config, CONFIG, DOCKERFILE)
    assert any(problem in p for p in problems), problems


@pytest.mark.skipif(
    not SCHEMA.is_file(),
    reason=f"no devContainer.base.schema.json at {SCHEMA}: it ships in no "
    "PyPI/npm package; set DEVCONTAINER_SCHEMA to a copy to run this check",
)
def test_matches_the_official_schema():
    from jsonschema import Draft201909Validator

    schema = json.loads(SCHEMA.read_text())
    validator = Draft201909Validator(schema)
    config = load_jsonc(CONFIG.read_text())
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in validator.iter_errors(config)
    ]
    assert errors == []
    broken = {**config, "runArg": ["--gpus=all"]}  # a typo: the schema allows no unknown property
    assert not validator.is_valid(broken)
    assert not validator.is_valid({**config, "hostRequirements": {"gpu": "sometimes"}})


def devcontainer_cli() -> Path | None:
    """@devcontainers/cli as `make install` puts it (npm, into the venv); None where it is absent."""
    cli = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "devcontainer"
    node = shutil.which("node")
    if not cli.exists() or not node:
        return None
    major = run(node, "--version").stdout.strip().lstrip("v").split(".")[0]
    return cli if major.isdigit() and int(major) >= 20 else None  # the CLI needs Node 20


@pytest.mark.skipif(
    devcontainer_cli() is None,
    reason="@devcontainers/cli (npm, Node >= 20) is not installed "
    "in this venv: `make install` installs it where npm exists",
)
def test_the_devcontainer_cli_finds_it_without_flags(tmp_path):
    # `read-configuration` lists the workspace's containers first; a docker that answers nothing stands in
    # for the engine that CI does not have. The CLI does not validate the config: the tests above do.
    docker = tmp_path / "docker"
    docker.write_text("#!/bin/sh\nexit 0\n")
    docker.chmod(0o755)
    cli = str(devcontainer_cli())
    proc = run(cli, "read-configuration", "--workspace-folder", str(REPO), "--docker-path", str(docker))
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["configuration"]
    assert found["configFilePath"]["path"] == str(CONFIG)
    assert found["build"]["target"] == "dev"
    # without the link the same workspace has no dev container
    bare = tmp_path / "ws"
    shutil.copytree(REPO / "devcontainer", bare / "devcontainer")
    proc = run(cli, "read-configuration", "--workspace-folder", str(bare), "--docker-path", str(docker))
    assert proc.returncode != 0 and not re.search(r'"configuration"', proc.stdout)
