"""Weight transports as variants: the registry resolves names and import paths with errors that name the key, a
user's transport brings its own config rule, and no module outside a transport's own names it (the processes ask
the class, :mod:`asyncrl.transport.base`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.variants import TRANSPORTS
from asyncrl.transport.base import Transport, transport_of

SRC = Path(__file__).resolve().parents[2] / "src"
PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "user_plugins"


def test_builtin_names_resolve_to_their_classes_with_their_flags():
    classes = {name: TRANSPORTS.get(name) for name in TRANSPORTS.names()}
    assert {n: c.name for n, c in classes.items()} == {"filesystem": "filesystem", "ipc": "ipc", "nccl": "nccl"}
    assert [n for n, c in classes.items() if c.streamed] == ["ipc", "nccl"]
    assert [n for n, c in classes.items() if c.rendezvous] == ["nccl"]
    assert [n for n, c in classes.items() if c.adapters] == ["filesystem"]
    assert transport_of(compose_config([])) is classes["filesystem"]


@pytest.mark.parametrize(
    "value,message",
    [
        ("shm", "weights.transport='shm' is not allowed; allowed values: 'filesystem', 'ipc', 'nccl'"),
        ("no_such_module:X", "weights.transport='no_such_module:X': cannot import no_such_module"),
        ("asyncrl.transport.files:Nope", "asyncrl.transport.files has no 'Nope'"),
        ("asyncrl.transport.files:FilePublisher", "is not a subclass of asyncrl.transport.base:Transport"),
    ],
)
def test_a_bad_transport_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compose_config([f"weights.transport={value}"])


def test_a_users_transport_by_import_path_brings_its_own_rule(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    cfg = compose_config(["weights.transport=my_transport:LoggedFiles"])
    assert transport_of(cfg).name == "logged_files" and issubclass(transport_of(cfg), Transport)
    with pytest.raises(ConfigError, match="my_transport:LoggedFiles needs strict_async=true"):
        compose_config(["weights.transport=my_transport:LoggedFiles", "strict_async=false"])


def test_a_registered_transport_is_found_by_name():
    @TRANSPORTS.register("test_only_files")
    class Mine(TRANSPORTS.get("filesystem")):
        name = "test_only_files"

    try:
        assert transport_of(compose_config(["weights.transport=test_only_files"])) is Mine
        assert "test_only_files" in TRANSPORTS.names()
    finally:
        del TRANSPORTS.registered["test_only_files"]


def test_no_module_outside_a_transport_names_it():
    """A transport's name appears as a string only in its own module, the registry and the config's default:
    everything else asks the class (its flags and hooks)."""
    own = {name: path.partition(":")[0] for name, path in TRANSPORTS.builtin.items()}
    allowed = {"asyncrl.config.variants", "asyncrl.config.inference"}  # the registry; the schema's default
    found = []
    for py in sorted(SRC.rglob("*.py")):
        module = ".".join(py.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Constant) and node.value in own and module not in (allowed | {own[node.value]}):
                found.append(f"{py.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_the_documented_transport_is_the_one_the_tests_run():
    """docs/extending.md shows tests/fixtures/user_plugins/my_transport.py (after its docstring) verbatim."""
    doc = (SRC.parent / "docs" / "extending.md").read_text()
    shown = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert shown == (PLUGINS / "my_transport.py").read_text().split('"""', 2)[2].lstrip("\n")
