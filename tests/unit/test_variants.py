"""Weight transports and RL losses as variants: the registries resolve names and import paths with errors
that name the key, a user's variant brings its own config rule, and no module outside a variant's own names
it (the processes ask the class: :mod:`asyncrl.transport.base`, :mod:`asyncrl.losses.base`)."""

from __future__ import annotations

import ast
import re
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
    # its own settings, in weights.args, which it checks; a built-in takes none
    mine = compose_config(["weights.transport=my_transport:LoggedFiles", "+weights.args.log=v.jsonl"])
    assert mine.weights.args == {"log": "v.jsonl"}
    with pytest.raises(ConfigError, match=r"weights.args has \['lgo'\]; my_transport:LoggedFiles takes log"):
        compose_config(["weights.transport=my_transport:LoggedFiles", "+weights.args.lgo=v.jsonl"])
    with pytest.raises(ConfigError, match="weights.transport=filesystem takes no args"):
        compose_config(["+weights.args.log=v.jsonl"])


def test_a_transport_with_a_manifest_needs_the_vllm_sidecar_streamed_or_not():
    """The hf sidecar loads files only: a transport that publishes a manifest is refused with it when the
    config is checked, not at its first update."""
    files = TRANSPORTS.get("filesystem")
    TRANSPORTS.register("test_only_manifest")(
        type("Manifest", (files,), {"manifest": "m.json", "worker_load": classmethod(lambda *a: set())})
    )
    try:
        with pytest.raises(
            ConfigError, match="weights.transport=test_only_manifest needs inference.backend=vllm"
        ):
            compose_config(["weights.transport=test_only_manifest", "inference.backend=hf"])
    finally:
        del TRANSPORTS.registered["test_only_manifest"]


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
    use: a transport without a publisher, one with a manifest but no worker loader, one with a rendezvous but
    no description of the group, a loss without its policy term."""
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
            "worker_load,",
        ),
        "test_only_no_join": (
            type("NoJoin", (files,), {"rendezvous": True}),
            TRANSPORTS,
            "join_info,",
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


# how a module would name a variant besides the string itself: a transport in its config forms
# (``weights.transport=nccl``, its section ``weights.nccl``), a loss by its name anywhere (the names are
# words of their own), in code, messages, comments and docstrings alike
MENTIONS = {
    "weights.transport": lambda n: rf"transport=['\"]?{n}\b|\bweights\.{n}\b",
    "trainer.loss.type": lambda n: rf"\b{n}\b",
}
# where a variant may be named: the registry, the schema (each variant's section and the help text the
# reference is generated from) and the map of renamed keys; a transport may build on the one that publishes
# files (asyncrl.transport.files:Files, the documented base of every transport that writes files)
ALLOWED = {
    "asyncrl.config.variants",
    "asyncrl.config.inference",
    "asyncrl.config.trainer",
    "asyncrl.config.renamed",
}


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def names_outside(registry, src: Path) -> list[str]:
    """Every place in ``src`` outside a variant's own module (and :data:`ALLOWED`) that names it: as a
    string, in its config forms (:data:`MENTIONS`), or by importing its module."""
    own = {name: path.partition(":")[0] for name, path in registry.builtin.items()}
    found = []
    for py in sorted(src.rglob("*.py")):
        module = ".".join(py.relative_to(src).with_suffix("").parts)
        text = py.read_text()
        tree = ast.parse(text)
        where = str(py.relative_to(src))
        for name, home in own.items():
            if module in ALLOWED | {home}:
                continue
            found += [
                f"{where}:{n.lineno} {name!r}"
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and n.value == name
            ]
            for m in re.finditer(MENTIONS[registry.key](name), text):
                found.append(f"{where}:{text.count(chr(10), 0, m.start()) + 1} {m.group(0)!r}")
            files_base = home == "asyncrl.transport.files" and module.startswith("asyncrl.transport.")
            if home in _imports(tree) and not files_base:
                found.append(f"{where} imports {home}")
    return found


@pytest.mark.parametrize("registry", [TRANSPORTS, LOSSES], ids=lambda r: r.key)
def test_no_module_outside_a_variant_names_it(registry):
    """Nothing outside a variant's own module asks which variant it is: the processes ask the class (its
    flags and hooks)."""
    assert not (found := names_outside(registry, SRC)), found


def test_the_check_finds_each_way_of_naming_a_variant(tmp_path):
    """The check above, on a package that names the variants each way it looks for."""
    pkg = tmp_path / "asyncrl" / "somewhere"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text(
        "import asyncrl.transport.ipc\n"
        "from asyncrl.losses.gspo import GSPO\n"
        "MODE = 'nccl'\n"
        "# the sidecars join the group at weights.nccl.host\n"
        "def f(t):\n"
        "    return f'needs weights.transport={t}' if t else 'see weights.transport=ipc'\n"
        '"""as cispo does"""\n'
    )
    transports, losses = names_outside(TRANSPORTS, tmp_path), names_outside(LOSSES, tmp_path)
    assert sorted(f.split(" ", 1)[1] for f in transports) == [
        "'nccl'",
        "'transport=ipc'",
        "'weights.nccl'",
        "imports asyncrl.transport.ipc",
    ], transports
    assert sorted(f.split(" ", 1)[1] for f in losses) == ["'cispo'", "'gspo'", "imports asyncrl.losses.gspo"]


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
