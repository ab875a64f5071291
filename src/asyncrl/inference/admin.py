"""What every sidecar backend shares: who may call admin routes, and how weights requests are checked."""

from __future__ import annotations

from pathlib import Path

from asyncrl.paths import STABLE
from asyncrl.utils.atomic import verify_sealed

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def admin_refusal(client_host: str | None, authorization: str | None, admin_token: str | None) -> str | None:
    """Why a caller may not use admin routes, or ``None``: loopback clients may; others need the token."""
    if (client_host or "") in LOOPBACK or (admin_token and authorization == f"Bearer {admin_token}"):
        return None
    return "admin routes accept loopback clients only (or a bearer admin_token)"


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


def weights_problem(path: Path, nccl: bool = False) -> tuple[int, str] | None:
    """``(status, reason)`` when ``path`` cannot be a weights directory, else ``None``. With ``nccl``
    (the backend receives broadcasts) a directory holding a transfer manifest is acceptable too."""
    from asyncrl.transport.nccl import MANIFEST

    if not path.is_dir():
        return 404, f"weights directory {path} does not exist"
    if (path / MANIFEST).is_file() and not nccl:
        return 400, (
            f"{path} holds an NCCL transfer manifest, not weights; this sidecar was not started "
            "with weights.transport=nccl"
        )
    if not any(path.glob("*.safetensors")) and not (path / MANIFEST).is_file():
        return 400, f"no *.safetensors files in {path}"
    if (path / STABLE).is_file() and (problem := verify_sealed(path)):  # published by a trainer: check its manifest
        return 400, problem
    return None
