"""Lets DVC's Hydra composition (``dvc exp run``) compose ``conf/``: registers asyncrl's typed schema.

``conf/config.yaml`` starts its defaults list with ``schema``, the :class:`asyncrl.config.Config`
dataclass that :func:`asyncrl.config.compose.compose_config` registers in Hydra's ConfigStore before it
composes. DVC composes ``conf/`` itself (``dvc/utils/hydra.py:compose_and_dump``) and offers one hook
to run code first: it puts ``hydra.plugins_path`` (``.dvc/config``) on ``sys.path`` while Hydra scans
the ``hydra_plugins`` namespace package, and Hydra imports every module it finds there. Importing this
one registers the schema, so ``dvc exp run -S key=value`` gets the same types, key checks and resolved
values as ``asyncrl <command> key=value``. It is not a Hydra plugin class; nothing else imports it.
"""

try:
    from asyncrl.config.compose import register_schema
except ImportError as e:  # Hydra would only warn and then fail on the missing 'schema': say why here
    raise RuntimeError(
        "DVC composes asyncrl's conf/ with asyncrl's schema: run dvc from the environment "
        f"where asyncrl is installed (e.g. .venv/bin/dvc) [{e}]"
    ) from None

register_schema()
