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
