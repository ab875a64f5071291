"""The golden pipeline: a short prepare -> SFT -> RL (-> eval) run whose hashes ``golden.json`` commits.

Shared by tests/integration/test_golden.py (on the host, under many outer environments) and tests/container
(inside the cpu image). Every path is relative to the run's folder, so the same commands run on the host
(cwd = that folder) and in the image (the folder mounted at /runs, the image's working directory).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from helpers.launch import MICRO_MODEL, SMALL_TASK
from helpers.metrics import learning_metrics

GOLDEN = Path(__file__).parents[1] / "golden.json"


def stages(mode: str, rl: bool = True, evaluate: bool = False, sft_steps: int = 30) -> list[tuple[str, ...]]:
    """The ``asyncrl`` commands: prepare, 30 SFT steps, 4 RL steps of 8 prompts x 8 samples, an eval of 8
    prompts."""
    common = ["data_dir=data", *SMALL_TASK, "seq_len=128", f"numerics={mode}"]
    out = [
        ("prepare", *common, *MICRO_MODEL, "model.name=base"),
        ("sft", *common, "model.name=base", "sft.run_dir=sft", f"sft.max_steps={sft_steps}"),
    ]
    if rl:
        out.append(
            (
                "rl",
                *common,
                "model.name=sft/model",
                "run_dir=rl",
                "max_steps=4",
                "orchestrator.prompts_per_step=8",
                "orchestrator.group_size=8",
                "orchestrator.max_tokens=10",
                "trainer.optim.lr=1e-3",
                "launcher.progress=false",
            )
        )
    if evaluate:
        out.append(
            (
                "eval",
                *common,
                "model.name=rl/model",
                "eval.out_dir=eval",
                "eval.num_examples=8",
                "eval.n=2",
                "orchestrator.max_tokens=10",
            )
        )
    return out


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _metrics_hash(*files: Path) -> str:
    return hashlib.sha256(
        json.dumps([learning_metrics(f) for f in files], sort_keys=True).encode()
    ).hexdigest()


def hashes(root: Path) -> dict[str, str]:
    """The models' and the learning metrics' hashes of whichever stages ran in ``root``."""
    out = {
        "base_model": file_hash(root / "base" / "model.safetensors"),
        "sft_model": file_hash(root / "sft" / "model" / "model.safetensors"),
        "sft_metrics": _metrics_hash(root / "sft" / "metrics" / "sft.jsonl"),
    }
    if (root / "rl" / "model").exists():
        out["rl_model"] = file_hash(root / "rl" / "model" / "model.safetensors")
        out["rl_metrics"] = _metrics_hash(
            *(root / "rl" / "metrics" / f"{p}.jsonl" for p in ("orchestrator", "trainer"))
        )
    if (root / "eval").exists():
        out["eval_metrics"] = file_hash(root / "eval" / "metrics.json")
        out["eval_samples"] = file_hash(root / "eval" / "samples.jsonl")
    return out


def run_pipeline(
    root: Path,
    run: Callable[[tuple[str, ...]], None],
    mode: str,
    rl: bool = True,
    evaluate: bool = False,
    sft_steps: int = 30,
) -> dict[str, str]:
    """Run the stages with ``run`` (which executes one ``asyncrl`` command in ``root``); return their
    hashes."""
    root.mkdir(parents=True, exist_ok=True)
    for args in stages(mode, rl, evaluate, sft_steps):
        run(args)
    return hashes(root)


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def compare(got: dict[str, str], where: str) -> str | None:
    """Why ``got`` differs from the committed hashes (``None`` if it does not)."""
    from asyncrl.numerics import cpu_info

    committed = golden()
    differ = sorted(k for k in committed["hashes"] if got.get(k) != committed["hashes"][k])
    if differ:
        return (
            f"{where}: {differ} differ from tests/{GOLDEN.name} (made on {committed['made_on']}); "
            f"this CPU: {cpu_info()['model']}"
        )
    return None
