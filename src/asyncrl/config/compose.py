"""Build a validated :class:`Config` from ``conf/`` plus Hydra overrides, or from a resolved YAML file.

Hydra's compose API rather than ``@hydra.main``: one CLI dispatches every command, and the
processes that ``asyncrl rl`` spawns must not change directory or take over logging. Errors from Hydra
and OmegaConf (unknown key, wrong type, unknown group option) and from our own bounds are re-raised as
:class:`ConfigError` whose message names the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config.fields import ConfigError
from asyncrl.config.invariants import check_config
from asyncrl.config.overrides import apply_entries, check_entries, check_overrides
from asyncrl.config.renamed import renamed_node, renamed_overrides
from asyncrl.config.root import Config
from asyncrl.paths import CONF_DIR

_registered = False


def register_schema() -> None:
    """Put the typed :class:`Config` into Hydra's ConfigStore as `schema` (idempotent; DVC's composition
    calls it through src/asyncrl/config/hydra_dvc)."""
    global _registered
    if not _registered:
        ConfigStore.instance().store(name="schema", node=Config)
        _registered = True


def _to_config(node) -> Config:
    try:
        cfg = OmegaConf.to_object(node)
    except OmegaConfBaseException as e:  # interpolation or type errors surface at resolution time
        raise ConfigError(f"invalid config: {e}") from None
    assert isinstance(cfg, Config), type(cfg)
    return check_config(cfg)


def compose_config(overrides: Sequence[str] = (), config_dirs: Sequence[str | Path] = ()) -> Config:
    """Compose ``conf/config.yaml`` with Hydra ``overrides`` (``key=value``, ``group=option``,
    ``+key=value``).

    ``config_dirs`` are searched for group options too (your own ``env/*.yaml``, ``experiment/*.yaml``).
    """
    register_schema()
    extra = []
    for d in config_dirs:
        if not Path(d).is_dir():
            raise ConfigError(f"invalid config: --config-dir {d} is not a directory")
        extra.append(f"file://{Path(d).resolve()}")
    search = [f"hydra.searchpath=[{','.join(extra)}]"] if extra else []
    # before Hydra, whose typo hint (`+key=value`) drops the key
    hydra_overrides, entries = check_overrides(renamed_overrides(overrides), config_dirs)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            node = compose(config_name="config", overrides=search + hydra_overrides)
        apply_entries(node, entries)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"invalid config: {_hydra_message(e)}") from None
    return _to_config(node)


def load_config_file(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load a resolved config (as written to ``<run_dir>/configs/config.yaml``) plus ``key=value``
    overrides."""
    overrides = renamed_overrides(overrides)
    _, entries = check_overrides(overrides)
    try:
        loaded = renamed_node(OmegaConf.load(path))  # type: ignore[arg-type]
        node = OmegaConf.merge(OmegaConf.structured(Config), loaded)
        check_entries(node, entries)
        node = OmegaConf.merge(node, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {e}") from None
    return _to_config(node)


def load_config(
    overrides: Sequence[str] = (),
    config_file: str | Path | None = None,
    config_dirs: Sequence[str | Path] = (),
) -> Config:
    return (
        load_config_file(config_file, overrides) if config_file else compose_config(overrides, config_dirs)
    )


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of the config (for W&B)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(out, dict)
    return out


def _hydra_message(e: BaseException | None) -> str:
    # Hydra wraps the OmegaConf error that names the key; show the innermost useful message.
    msgs = []
    while e is not None:
        text = str(e).strip()
        # OmegaConf chains an unformatted template ('$VALUE ...') behind the formatted message.
        if text and text not in msgs and "$VALUE" not in text:
            msgs.append(text)
        e = e.__cause__ or e.__context__
    return "\n  ".join(msgs)
