"""Lock what pip installs into an image: docker/locks/<image>.txt, one `name==version  artifact` a line.

    python docker/lock.py cpu dev gpu trainer    # `make image-lock`; needs the index, ~1 min an image

For each image, pip resolves the requirements that `docker/install.sh <image> deps` installs (its
`requirements` phase prints them) with the image's Python on this machine's platform (`pip install
--dry-run --report`, no config files), and the lock records the file pip picks: a wheel, or an sdist where
the package ships no wheel for that Python and platform. tests/static/test_image_locks.py then checks,
offline, that every sdist in a lock is built into a wheel by the Dockerfile's builder stage
(docker/source-only.txt) and that the locks match the pins of pyproject.toml and install.sh.

The CPU torch comes from its own index (TORCH_INDEX_URL, wheels only) before the rest, as install.sh installs
it: the lock records its pin and resolves the rest with torch already installed. The platform is this
machine's (Linux x86_64, glibc 2.36, the cpu image's Debian bookworm); for the gpu and trainer images (Ubuntu
24.04, glibc 2.39) that is conservative: a wheel picked here installs there. The trainer's torch (the gpu image's,
from PyPI) is resolved with the rest, as install.sh installs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "docker" / "locks"
# the CPU torch, installed on its own from a wheel-only index before the rest (docker/install.sh)
SEPARATE_TORCH = {"cpu", "dev"}


def requirements(image: str) -> list[str]:
    """What `docker/install.sh IMAGE deps` installs, as its `requirements` phase prints it."""
    out = subprocess.run(
        ["bash", str(ROOT / "docker" / "install.sh"), image, "requirements"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def inputs_digest(reqs: list[str]) -> str:
    """sha256 of the requirement lines: a lock whose digest differs was made for other pins."""
    return hashlib.sha256("\n".join(reqs).encode()).hexdigest()


def resolve(python: str, image: str, reqs: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
        torch, rest = reqs[0], reqs[1:]
        if image in SEPARATE_TORCH:
            # torch as install.sh's first step leaves it: installed, its own dependencies with it
            site = next(venv.glob("lib/python*/site-packages"))
            version = torch.split("==")[1]
            info = site / f"torch-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        else:
            rest = reqs
        report = Path(tmp) / "report.json"
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}
        subprocess.run(
            [
                sys.executable,  # this pip (the images upgrade theirs to >= 25), resolving for the venv's Python
                "-m",
                "pip",
                "--python",
                str(venv / "bin" / "python"),
                "install",
                "--dry-run",
                "--quiet",
                "--report",
                str(report),
                *rest,
            ],
            check=True,
            env=env,
        )
        picked = json.loads(report.read_text())["install"]
    lines = [f"{torch}  (TORCH_INDEX_URL: wheels only)"] if image in SEPARATE_TORCH else []
    for item in sorted(picked, key=lambda i: i["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        artifact = Path(unquote(urlparse(item["download_info"]["url"]).path)).name
        lines.append(f"{name}=={version}  {artifact}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="+", choices=("cpu", "dev", "gpu", "trainer"))
    parser.add_argument("--python", default="python3.12", help="the images' Python version (default python3.12)")
    args = parser.parse_args()
    LOCKS.mkdir(exist_ok=True)
    for image in args.images:
        reqs = requirements(image)
        lines = resolve(args.python, image, reqs)
        head = [
            f"# what `docker/install.sh {image} deps` installs: `make image-lock` (docker/lock.py) writes this",
            f"# inputs {inputs_digest(reqs)}",
        ]
        (LOCKS / f"{image}.txt").write_text("\n".join(head + lines) + "\n")
        sdists = [line for line in lines if not line.endswith(".whl") and "TORCH_INDEX_URL" not in line]
        print(f"{image}: {len(lines)} packages, built from source: {', '.join(sdists) or 'none'}")


if __name__ == "__main__":
    main()
