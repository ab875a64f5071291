"""What every sidecar backend shares: who may call admin routes, and how weights requests are checked."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from asyncrl.inference.errors import BadRequest
from asyncrl.paths import STABLE
from asyncrl.transport.base import Transport, manifests
from asyncrl.utils.atomic import verify_sealed

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


# headers a proxy adds: a request that carries one was relayed, whatever address it arrives from
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def admin_refusal(
    client_host: str | None, headers: Mapping[str, str], admin_token: str | None
) -> str | None:
    """Why a caller may not use admin routes, or ``None``: loopback clients may; others need the token.

    A request relayed by a proxy is never taken as loopback, even when the server underneath trusts forwarded
    headers (uvicorn's ``FORWARDED_ALLOW_IPS='*'``, which vLLM's server honours) and so reports the address
    the header claims: the caller's real address is unknown.
    """
    if admin_token and headers.get("authorization") == f"Bearer {admin_token}":
        return None
    if (client_host or "") in LOOPBACK and not any(h in headers for h in PROXY_HEADERS):
        return None
    return "admin routes accept loopback clients only, not relayed by a proxy (or a bearer admin_token)"


def weights_roots(cfg) -> list[Path]:
    """Where ``/update_weights`` may load from: ``inference.weights_roots``, or by default the run directory
    and the starting model's directory (resolved: a symlink or ``..`` cannot lead outside them)."""
    roots = list(cfg.inference.weights_roots) or [cfg.run_dir, cfg.model.name]
    return [Path(r).resolve() for r in roots]


def update_refusal(path: Path, version: int, current: int, roots: list[Path]) -> tuple[int, str] | None:
    """``(status, reason)`` when a weights update must be refused before anything is read: a directory
    outside ``roots`` (403), or a version older than the one served (409; the same version reloads)."""
    real = path.resolve()
    if roots and not any(real == r or real.is_relative_to(r) for r in roots):
        return 403, (
            f"{path} is outside the directories this sidecar loads weights from "
            f"({', '.join(map(str, roots))}; inference.weights_roots)"
        )
    if version < current:
        return 409, f"version {version} is older than the served version {current}; versions only go forward"
    return None


def weights_problem(path: Path, transport: type[Transport] = Transport) -> tuple[int, str] | None:
    """``(status, reason)`` when ``path`` cannot be a weights directory, else ``None``. A sidecar started for
    a ``transport`` with a manifest (one that sends the weights itself) also accepts a directory holding that
    manifest; the base
    :class:`Transport` means files only (the built-in backend)."""
    if not path.is_dir():
        return 404, f"weights directory {path} does not exist"
    for name, kind in manifests().items():
        if (path / name).is_file() and name != transport.manifest:
            return 400, (
                f"{path} holds an {kind} transfer manifest, not weights; this sidecar was not started "
                f"with weights.transport={kind}"
            )
    if not any(path.glob("*.safetensors")) and not (
        transport.manifest and (path / transport.manifest).is_file()
    ):
        return 400, f"no *.safetensors files in {path}"
    # published by a trainer: check its manifest
    if (path / STABLE).is_file() and (problem := verify_sealed(path)):
        return 400, problem
    return None


def checked_update(
    body_path: str, version: int, current: int, roots: list[Path] | None, transport: type[Transport]
) -> Path:
    """The weights directory of an update request, or :class:`BadRequest` saying why it cannot be loaded:
    outside ``roots`` (403; ``None``: anywhere), older than ``current`` (409), not a weights directory (404,
    400)."""
    path = Path(body_path)
    if roots is not None and (refusal := update_refusal(path, version, current, roots)):
        raise BadRequest(refusal[1], refusal[0], "path" if refusal[0] == 403 else "version")
    if problem := weights_problem(path, transport):
        raise BadRequest(problem[1], problem[0], "path")
    return path
