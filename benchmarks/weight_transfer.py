"""Full weight-update latency, trainer to serving: safetensors files against an NCCL broadcast. Two GPUs.

The trainer side is the real one (Fabric, FSDP2, fp32 master weights exported in bf16) in this process on
GPU 1; the sidecar is ``asyncrl serve inference.backend=vllm weights.transport=nccl`` on GPU 0, which
also still loads files. Model: the Qwen3-0.6B shape (random init). Each repeat perturbs the weights (a new
policy), then, side by side:
  files: export ``step_N`` (gather, bf16 cast, safetensors, rename; /dev/shm) + ``POST /update_weights``;
  nccl:  write the manifest + ``POST /update_weights`` (the sidecar receives) while this process broadcasts.
Latency is from the start of the export/broadcast until ``/update_weights`` returns. After each nccl
update a greedy completion is compared with the one after loading the same weights from files: they
must be equal, and must change from policy to policy at least once, or the run fails.

    CUDA_VISIBLE_DEVICES=1 python benchmarks/weight_transfer.py --sidecar-gpu 0 --out $OUT/weight_transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = ["model=qwen3_0.6b_shape"]


def greedy(url: str) -> list[int]:
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0.0, "return_token_ids": True},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def post(url: str, route: str, body: dict, out: dict) -> None:
    import httpx

    r = httpx.post(f"{url}/{route}", json=body, timeout=600)
    out["status"], out["body"] = (
        r.status_code,
        r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text,
    )
    out["done"] = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sidecar-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the sidecar (this process: its own)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/weight_transfer.json")
    args = ap.parse_args()

    import torch

    from asyncrl.config.compose import compose_config
    from asyncrl.launcher.process import spawn, stop, wait_healthy
    from asyncrl.models import build_tiny_model
    from asyncrl.trainer.common import build_train_state, export_model
    from asyncrl.transport.nccl import NCCLSender, export_entries, write_manifest
    from asyncrl.utils.process import free_port

    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    model_dir = build_tiny_model(compose_config(MODEL).model.init, root / "model", seed=0)
    port, nccl_port = free_port(), free_port()
    overrides = [
        *MODEL,
        f"model.name={model_dir}",
        "inference.backend=vllm",
        "weights.transport=nccl",
        f"weights.nccl_port={nccl_port}",
        "trainer.fabric.accelerator=cuda",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.precision=bf16-mixed",
        "trainer.fabric.num_threads=0",
        "inference.vllm.gpu_memory_utilization=0.5",
    ]
    cfg = compose_config(overrides)
    sidecar = spawn(
        "sidecar",
        [sys.executable, "-m", "asyncrl", "serve", *overrides, f"inference.port={port}"],
        root / "sidecar.log",
        {"CUDA_VISIBLE_DEVICES": args.sidecar_gpu},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(sidecar, url, timeout_s=600)
        fabric, raw, tokenizer, _ = build_train_state(cfg, cfg.trainer.optim, cfg.trainer.scheduler, 10)
        joined: dict = {}
        t = threading.Thread(
            target=post,
            args=(
                url,
                "init_weight_transfer",
                {"master_address": "127.0.0.1", "master_port": nccl_port, "rank_offset": 1, "world_size": 2},
                joined,
            ),
        )
        t.start()
        sender = NCCLSender(cfg, fabric.global_rank)  # rank 0 of the group; returns once the sidecar joined
        t.join()
        assert joined["status"] == 200, joined
        entries = export_entries(raw, torch.bfloat16)
        rows, previous, changed = [], greedy(url), 0
        for r in range(args.repeats + 1):
            with torch.no_grad():  # a new policy: every parameter moves
                for p in raw.parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p  # this rank's FSDP2 shard
                    local.add_(torch.randn_like(local) * 0.02)
            version = 2 * r + 1
            manifest = root / f"step_{version}"
            t0 = time.perf_counter()
            write_manifest(manifest, entries, version)
            res: dict = {}
            t = threading.Thread(
                target=post, args=(url, "update_weights", {"path": str(manifest), "version": version}, res)
            )
            t.start()
            sender.send(raw, torch.bfloat16)
            t.join()
            nccl_s, nccl_server_s = res["done"] - t0, res["body"]["seconds"]
            assert res["status"] == 200, res
            via_nccl = greedy(url)

            files = root / f"step_{version + 1}"
            t0 = time.perf_counter()
            export_model(fabric, raw, tokenizer, files, "bfloat16")
            t1 = time.perf_counter()
            res = {}
            post(url, "update_weights", {"path": str(files), "version": version + 1}, res)
            assert res["status"] == 200, res
            files_s, export_s = res["done"] - t0, t1 - t0
            via_files = greedy(url)
            if via_nccl != via_files:
                raise SystemExit(f"repeat {r}: greedy after the broadcast {via_nccl} != after the files {via_files}")
            changed += via_files != previous
            previous = via_files
            if r:  # the first repeat warms up both paths
                rows.append(
                    {"nccl_s": nccl_s, "nccl_server_s": nccl_server_s, "files_s": files_s, "export_s": export_s}
                )
            print(
                f"repeat {r}: nccl {nccl_s:.3f}s (sidecar {nccl_server_s:.3f}s), files {files_s:.3f}s "
                f"(export {export_s:.3f}s)",
                flush=True,
            )
        if not changed:
            raise SystemExit("the greedy completion never changed: the updates did not reach the sidecar")
    finally:
        stop([sidecar], timeout_s=60)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print("\n| path | median s | vs files |\n|---|---:|---:|")
    print(f"| files (/dev/shm): export + reload | {med['files_s']:.3f} | 1.00 |")
    print(
        f"| nccl broadcast (sidecar side {med['nccl_server_s']:.3f} s) | {med['nccl_s']:.3f} | "
        f"{med['nccl_s'] / med['files_s']:.2f} |"
    )
    result = {
        "benchmark": "weight_transfer",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "params": sum(p.numel() for p in raw.parameters()),
        "repeats": rows,
        "median": med,
        "greedy_equal_after_nccl_and_files": True,
        "greedy_changed_repeats": changed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
