"""Every path of a run directory, in one place (DESIGN.md "Run directory"; dvc.yaml uses the same layout).

```
<run_dir>/configs/config.yaml      resolved config (+ overrides.yaml), written before launch
         run_meta.json             git sha + dirty flag, package versions, devices, argv
         logs/<process>.log        inference, orchestrator, trainer
         rollouts/step_N/          micro-batches of step N (orchestrator -> trainer)
         weights/step_N/           policy N, HF layout, safetensors (trainer -> sidecar)
         checkpoints/step_N/{trainer,orchestrator}/
         metrics/<process>.jsonl   always-on metrics sink
         samples/step_N.jsonl      prompts, completions, rewards, advantages
         model/                    the final policy (an HF directory)
```
A directory hand-off is complete only when its ``STABLE`` marker exists (see :mod:`asyncrl.utils.atomic`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent / "conf"  # the packaged config groups Hydra composes
STABLE = "STABLE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def stable(path: Path) -> bool:
    return (path / STABLE).exists()


def list_steps(parent: Path, require_stable: bool = True) -> list[int]:
    """Sorted step numbers of ``parent/step_N`` directories (complete ones only by default)."""
    if not parent.is_dir():
        return []
    steps = []
    for child in parent.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (not require_stable or stable(child)):
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    configs = property(lambda self: self.root / "configs")
    config_file = property(lambda self: self.configs / "config.yaml")
    overrides_file = property(lambda self: self.configs / "overrides.yaml")
    meta_file = property(lambda self: self.root / "run_meta.json")
    logs = property(lambda self: self.root / "logs")
    rollouts = property(lambda self: self.root / "rollouts")
    weights = property(lambda self: self.root / "weights")
    checkpoints = property(lambda self: self.root / "checkpoints")
    metrics = property(lambda self: self.root / "metrics")
    samples = property(lambda self: self.root / "samples")
    model = property(lambda self: self.root / "model")
    profile = property(lambda self: self.root / "profile")  # trainer.profile_step

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def metrics_file(self, process: str) -> Path:
        return self.metrics / f"{process}.jsonl"

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def weights_step(self, step: int) -> Path:
        return self.weights / f"step_{step}"

    def checkpoint(self, step: int, process: str | None = None) -> Path:
        path = self.checkpoints / f"step_{step}"
        return path / process if process else path

    def samples_step(self, step: int) -> Path:
        return self.samples / f"step_{step}.jsonl"

    def create(self) -> RunDir:
        """Make the directories every process writes to; hand-off folders appear when first written."""
        for d in (self.configs, self.logs, self.metrics):
            d.mkdir(parents=True, exist_ok=True)
        return self


def data_file(data_dir: str | Path, env_name: str, split: str) -> Path:
    """Task data of one environment split, written by ``asyncrl prepare``."""
    return Path(data_dir) / env_name / f"{split}.jsonl"
