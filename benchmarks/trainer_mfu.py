"""Trainer tokens/s and MFU on the Qwen3-0.6B shape (random init, vocab 151936), packed rows, one GPU.

Runs the real trainer step (Fabric, FSDP2 on one GPU, bf16-mixed, RL loss over packed micro-batches)
on random samples packed into rows of each ``--row-lens``, for each attention implementation, each
configuration in a fresh process. Prints a table and writes JSON.

    python benchmarks/trainer_mfu.py --row-lens 8192 16384 --attn varlen sdpa --out $OUT/trainer_mfu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model=qwen3_0.6b_shape", "model.init.vocab_size=151936"]
# --smoke: the same code on CPU with a micro shape, to check the script without a GPU
SMOKE_MODEL = [
    "model=qwen3_0.6b_shape",
    "model.init.hidden_size=64",
    "model.init.num_hidden_layers=2",
    "model.init.intermediate_size=128",
    "model.init.num_attention_heads=4",
    "model.init.num_key_value_heads=2",
    "model.init.head_dim=16",
    "model.init.vocab_size=1000",
]
DEVICE = ["trainer.fabric.accelerator=cuda", "trainer.fabric.strategy=fsdp2", "trainer.fabric.precision=bf16-mixed"]
SMOKE_DEVICE = ["trainer.fabric.accelerator=cpu", "trainer.fabric.strategy=fsdp2", "trainer.fabric.precision=32-true"]


def build_model(path: Path, smoke: bool) -> None:
    from asyncrl.config.compose import compose_config
    from asyncrl.models import build_tiny_model

    build_tiny_model(compose_config(SMOKE_MODEL if smoke else MODEL).model.init, path, seed=0)


def one(model_dir: str, row_len: int, attn: str, ac: bool, steps: int, warmup: int, rows: int, smoke: bool) -> dict:
    import numpy as np
    import torch

    from asyncrl.config.compose import compose_config
    from asyncrl.orchestrator.packing import Sample, pack_samples
    from asyncrl.trainer.common import batch_to_torch, build_train_state, step_over_micro_batches
    from asyncrl.trainer.loss import rl_loss
    from asyncrl.trainer.perf import mfu

    cfg = compose_config(
        [
            *(SMOKE_MODEL if smoke else MODEL),
            f"model.name={model_dir}",
            f"model.attn_implementation={attn}",
            f"seq_len={row_len}",
            *(SMOKE_DEVICE if smoke else DEVICE),
            "trainer.fabric.num_threads=0",
            f"trainer.fabric.activation_checkpointing={str(ac).lower()}",
            f"orchestrator.max_tokens={min(1024, row_len // 2)}",
        ]
    )
    fabric, raw, _, state = build_train_state(cfg, cfg.trainer.optim, cfg.trainer.scheduler, 10**6)
    rng = np.random.default_rng(0)
    vocab = raw.config.vocab_size

    def batch():
        samples, total = [], 0
        while total < rows * row_len * 0.97:  # FFD fills rows nearly completely at these lengths
            p, c = int(rng.integers(64, 512)) % (row_len // 4) + 1, int(rng.integers(128, 1536)) % (row_len // 2) + 1
            samples.append(
                Sample(
                    rng.integers(0, vocab, p).tolist(),
                    rng.integers(0, vocab, c).tolist(),
                    (-rng.random(c)).tolist(),
                    float(rng.normal()),
                )
            )
            total += p + c
        mbs = pack_samples(samples, row_len, 0, rows_per_micro_batch=1, pad_multiple=128)
        return batch_to_torch(mbs), sum(int((mb["loss_mask"]).sum()) for mb in mbs)

    times, tokens = [], []
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    if not smoke:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        mbs, loss_tokens = batch()

        def lf(lp, mb, loss_tokens=loss_tokens):
            return rl_loss(
                lp,
                mb["inference_logprobs"][:, 1:],
                mb["advantages"][:, 1:],
                mb["loss_mask"][:, 1:],
                cfg.trainer.loss,
                loss_tokens,
            )

        sync()
        t = time.perf_counter()
        step_over_micro_batches(fabric, state.model, state.optimizer, state.scheduler, mbs, lf, 1.0)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            tokens.append(sum(int(mb["input_ids"].numel()) for mb in mbs))
    tok_s = statistics.median(n / t for n, t in zip(tokens, times, strict=True))
    device = "NVIDIA H100 (smoke test on CPU)" if smoke else torch.cuda.get_device_name()
    return {
        "row_len": row_len,
        "attn": attn,
        "activation_checkpointing": ac,
        "rows_per_step": rows,
        "step_s": statistics.median(times),
        "tokens_per_s": tok_s,
        "device": device,
        "mfu_matmul": mfu(tok_s, raw.config, row_len, device),
        "mfu_prime_rl": mfu(tok_s, raw.config, row_len, device, convention="prime_rl"),
        "peak_mem_gib": 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row-lens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--attn", nargs="+", default=["varlen", "sdpa"])
    ap.add_argument("--ac", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4, help="packed rows (micro-batches) per optimizer step")
    ap.add_argument("--out", default="benchmarks/results/trainer_mfu.json")
    ap.add_argument("--smoke", action="store_true", help="run on CPU with a micro shape (checks the script only)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(**json.loads(args.one))), flush=True)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, args.smoke)
        for row in args.row_lens:
            for attn in args.attn:
                for ac in args.ac:
                    spec = {
                        "model_dir": str(model_dir),
                        "row_len": row,
                        "attn": attn,
                        "ac": bool(ac),
                        "steps": args.steps,
                        "warmup": args.warmup,
                        "rows": args.rows,
                        "smoke": args.smoke,
                    }
                    proc = subprocess.run(
                        [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True
                    )
                    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode != 0 or not lines:
                        results.append({**spec, "error": proc.stderr[-1500:]})
                        print(f"row {row} attn {attn} ac {ac}: FAILED\n{proc.stderr[-1500:]}", flush=True)
                        continue
                    results.append(json.loads(lines[-1][7:]))
                    r = results[-1]
                    print(
                        f"row {row:>6} attn {attn:<7} ac {int(ac)}: {r['tokens_per_s']:>9.0f} tok/s  "
                        f"MFU {100 * r['mfu_matmul']:.1f}% (6N) / {100 * r['mfu_prime_rl']:.1f}% (PRIME-RL)  "
                        f"step {r['step_s']:.2f}s  peak {r['peak_mem_gib']:.1f} GiB",
                        flush=True,
                    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": "trainer_mfu",
                "command": " ".join(sys.argv),
                "date": time.strftime("%Y-%m-%d"),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
