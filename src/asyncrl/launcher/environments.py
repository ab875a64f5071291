"""The Python environments processes run in, and whether each holds what the config asks of its process.

``asyncrl rl`` starts the trainer from ``launcher.trainer_python`` and the sidecars from
``launcher.inference_python`` (each ``''``: the launcher's own interpreter), so the trainer can have an
environment apart from the sidecar's vLLM pins (flash-attn-4 needs newer nvidia-cutlass-dsl and
apache-tvm-ffi than vLLM 0.26 pins). Before anything starts, each interpreter is asked which versions of the
distributions its process needs it has (importing none of them: about a second for another interpreter,
nothing for the running one), and where it imports asyncrl from: this checkout, or the processes would run
different code. ``train``, ``sft`` and ``serve`` check their own interpreter the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

from asyncrl.config import Config
from asyncrl.transport.base import transport_of

# run by the interpreter asked: where it would import asyncrl from, and its versions of the distributions
# named
REPORT = """
import json, sys
from importlib import metadata, util
spec = util.find_spec("asyncrl")
versions = {}
for name in sys.argv[1:]:
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        versions[name] = None
print(json.dumps({"asyncrl": spec.origin if spec else None, "versions": versions}))
"""

# the processes each command runs, with the key that names their interpreter (None: the command's own)
PROCESSES = {
    "rl": (("trainer", "launcher.trainer_python"), ("inference", "launcher.inference_python")),
    "train": (("trainer", None),),
    "sft": (("trainer", None),),
    "serve": (("inference", None),),
}


def needs(cfg: Config, process: str) -> dict[str, str]:
    """The distributions ``process`` ("trainer" or "inference") needs under ``cfg``, each with the reason."""
    transport = transport_of(cfg).process_needs(cfg, process)
    if process == "inference":
        return {
            **transport,
            **({"vllm": "inference.backend=vllm"} if cfg.inference.backend == "vllm" else {}),
        }
    out = {"torch": "the trainer", **transport}
    if cfg.numerics == "bitwise":
        out["vllm"] = "numerics=bitwise: the trainer computes with vLLM's kernels"
    attn = cfg.model.attn_implementation
    if attn == "varlen_fa4":
        out["flash-attn-4"] = f"model.attn_implementation={attn}"
    elif attn == "flash_attention_2":
        out["flash-attn"] = f"model.attn_implementation={attn}"
    return out


def _versions(names: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@cache
def report(python: str, names: tuple[str, ...]) -> dict:
    """``{"asyncrl": the file it imports asyncrl from or None, "versions": {name: version or None}}`` of
    ``python``; ``ValueError`` saying why it could not be asked."""
    if Path(python).absolute() == Path(sys.executable).absolute():
        return {
            "asyncrl": str(Path(__file__).resolve().parents[1] / "__init__.py"),
            "versions": _versions(names),
        }
    try:
        proc = subprocess.run([python, "-c", REPORT, *names], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"cannot run it ({e})") from e
    if proc.returncode != 0:
        raise ValueError(f"it exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def environment_problems(cfg: Config, command: str) -> list[str]:
    """What the environments of ``command``'s processes lack for ``cfg``: an interpreter that runs, asyncrl
    from this checkout, the distributions :func:`needs` names."""
    problems = []
    here = Path(__file__).resolve().parents[1]  # the asyncrl package this process runs
    for process, key in PROCESSES.get(command, ()):
        chosen = getattr(cfg.launcher, key.split(".")[1]) if key else ""
        python = chosen or sys.executable
        named = f"{key}={python}" if chosen else f"{key}='' (this Python, {python})" if key else python
        wanted = needs(cfg, process)
        try:
            got = report(python, tuple(sorted(wanted)))
        except ValueError as e:
            problems.append(f"{named}: {e}")
            continue
        if got["asyncrl"] is None:
            problems.append(f"{named} has no asyncrl: install this checkout there (pip install -e .)")
        elif Path(got["asyncrl"]).resolve().parent != here:
            problems.append(
                f"{named} imports asyncrl from {Path(got['asyncrl']).resolve().parent}, the launcher from "
                f"{here}: install this checkout there (pip install -e .)"
            )
        missing = [f"{name} ({why})" for name, why in wanted.items() if got["versions"].get(name) is None]
        if missing:
            problems.append(f"{named} lacks what the {process} needs: {'; '.join(missing)}")
    return problems
