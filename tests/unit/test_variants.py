"""Weight transports and RL losses as variants: the registries resolve names and import paths with errors
that name the key, a user's variant brings its own config rule, and no module outside a variant's own names
it (the processes ask the class: :mod:`asyncrl.transport.base`, :mod:`asyncrl.losses.base`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.variants import LOSSES, TRANSPORTS
from asyncrl.transport.base import Transport, transport_of

SRC = Path(__file__).resolve().parents[2] / "src"
PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "user_plugins"


def test_builtin_names_resolve_to_their_classes_with_their_flags():
    classes = {name: TRANSPORTS.get(name) for name in TRANSPORTS.names()}
    assert {n: c.name for n, c in classes.items()} == {
        "filesystem": "filesystem",
        "nccl": "nccl",
        "ipc": "ipc",
    }
    assert [n for n, c in classes.items() if c.streamed] == ["nccl", "ipc"]
    assert [n for n, c in classes.items() if c.rendezvous] == ["nccl"]
    assert [n for n, c in classes.items() if c.adapters] == ["filesystem"]
    assert transport_of(compose_config([])) is classes["filesystem"]


@pytest.mark.parametrize(
    "value,message",
    [
        ("shm", "weights.transport='shm' is not allowed; allowed values: 'filesystem', 'nccl', 'ipc'"),
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


def test_a_variant_missing_a_hook_is_refused_when_the_config_is_checked():
    """An interface hook left to the base class (which only raises) is named at config time, not at first
    use: a transport without a publisher, one with a manifest but no sidecar loader, a loss without its
    policy term."""
    files, base, loss = (
        TRANSPORTS.get("filesystem"),
        TRANSPORTS.get("filesystem").__mro__[1],
        LOSSES.get("grpo"),
    )
    cases = {
        "test_only_no_publisher": (
            type("NoPublisher", (base,), {}),
            TRANSPORTS,
            "does not define publisher,",
        ),
        "test_only_no_loader": (
            type("NoLoader", (files,), {"manifest": "m.json"}),
            TRANSPORTS,
            "vllm_load,",
        ),
        "test_only_no_term": (
            type("NoTerm", (loss.__mro__[1],), {}),
            LOSSES,
            "does not define policy_term,",
        ),
    }
    for name, (cls, registry, message) in cases.items():
        registry.register(name)(cls)
        try:
            with pytest.raises(ConfigError, match=f"{registry.key}='{name}': .*{message}"):
                compose_config([f"{registry.key}={name}"])
        finally:
            del registry.registered[name]
    assert all(not c.missing_hooks() for c in TRANSPORTS.all() + LOSSES.all())


@pytest.mark.parametrize("registry", [TRANSPORTS, LOSSES], ids=lambda r: r.key)
def test_no_module_outside_a_variant_names_it(registry):
    """A variant's name appears as a string only in its own module, the registry and the config's default:
    everything else asks the class (its flags and hooks)."""
    own = {name: path.partition(":")[0] for name, path in registry.builtin.items()}
    # the registry; the schema's defaults
    allowed = {"asyncrl.config.variants", "asyncrl.config.inference", "asyncrl.config.trainer"}
    found = []
    for py in sorted(SRC.rglob("*.py")):
        module = ".".join(py.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(py.read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in own
                and module not in (allowed | {own[node.value]})
            ):
                found.append(f"{py.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_losses_resolve_with_their_flags_and_a_users_loss_checks_its_args(monkeypatch):
    assert [n for n in LOSSES.names() if LOSSES.get(n).sequence_level] == ["gspo"]
    with pytest.raises(
        ConfigError,
        match="trainer.loss.type='nope' is not allowed; allowed values: 'dppo_kl', 'grpo', 'gspo', 'cispo'",
    ):
        compose_config(["trainer.loss.type=nope"])
    with pytest.raises(ConfigError, match="trainer.loss.type=grpo takes no args"):
        compose_config(["trainer.loss.type=grpo", "+trainer.loss.args.cap=2"])
    monkeypatch.syspath_prepend(str(PLUGINS))
    mine = ["trainer.loss.type=my_loss:CappedReinforce"]
    assert (
        LOSSES.get(compose_config([*mine, "+trainer.loss.args.cap=1.5"]).trainer.loss.type).name
        == "capped_reinforce"
    )
    with pytest.raises(ConfigError, match=r"trainer.loss.args.cap=0.5 must be > 1"):
        compose_config([*mine, "+trainer.loss.args.cap=0.5"])
    with pytest.raises(ConfigError, match=r"trainer.loss.args has \['x'\]"):
        compose_config([*mine, "+trainer.loss.args.x=1"])
    with pytest.raises(
        ConfigError, match="trainer.fabric.context_parallel=2 does not run with trainer.loss.type=gspo"
    ):
        compose_config(
            [
                "trainer.loss.type=gspo",
                "trainer.fabric.context_parallel=2",
                "trainer.fabric.devices=2",
                "trainer.fabric.strategy=fsdp2",
                "trainer.fabric.accelerator=cuda",
            ]
        )


@pytest.mark.parametrize("module", ["my_transport", "my_loss"])
def test_the_documented_variants_are_the_ones_the_tests_run(module):
    """docs/extending.md shows tests/fixtures/user_plugins/<module>.py (after its docstring) verbatim."""
    doc = (SRC.parent / "docs" / "extending.md").read_text()
    shown = doc.split(f"<!-- {module}.py -->\n```python\n", 1)[1].split("```", 1)[0]
    assert shown == (PLUGINS / f"{module}.py").read_text().split('"""', 2)[2].lstrip("\n")
