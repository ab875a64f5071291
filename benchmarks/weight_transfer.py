"""Full weight-update latency, trainer to serving: NCCL broadcasts between two GPUs, or CUDA IPC handles on
one shared GPU (either loaded directly or by vLLM's layerwise reload), against safetensors files.

The trainer side is the real one (Fabric, FSDP2, fp32 master weights sent in bf16) in this process; the
sidecar is ``asyncrl serve inference.backend=vllm weights.transport=nccl|ipc``, on another GPU (nccl) or this
process's (ipc), which also still loads files. Models: the Qwen3-0.6B or Qwen3-4B shape (random init, char
vocabulary). Each repeat perturbs the weights (a new policy), then updates the sidecar every way, side by
side (the direct and layerwise modes' order alternates):
  direct:         nccl: manifest + ``POST /update_weights`` while this process broadcasts; ipc: the weights
                  copied into this process's shared buffer, manifest + ``POST /update_weights``; asyncrl's
                  worker extension copies each tensor into vLLM's parameters (``weights.reload=direct``);
  layerwise:      the same, loaded through vLLM's layerwise reload lifecycle (``weights.reload=layerwise``);
  files:          export ``step_N`` (gather, bf16 cast, safetensors, rename) + ``POST /update_weights``.
Latency is from the start of the broadcast/export until ``/update_weights`` returns. After each update a
greedy completion is taken: all must be equal within a repeat, and change from policy to policy at least
once, or the run fails.

    CUDA_VISIBLE_DEVICES=1 python benchmarks/weight_transfer.py --sidecar-gpu 0 --shape 4b --out $OUT/wt.json
    CUDA_VISIBLE_DEVICES=0 python benchmarks/weight_transfer.py --transport ipc --out $OUT/wt_ipc.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = {"0.6b": "model=qwen3_0.6b_shape", "4b": "model=qwen3_4b_shape"}


def greedy(url: str) -> list[int]:
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": "the quick brown fox",
            "max_tokens": 24,
            "temperature": 0.0,
            "return_token_ids": True,
        },
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


def scratch_root(need_bytes: int) -> Path:
    """/dev/shm when it holds ``need_bytes`` (the model, one export and slack), else the temp directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes else None
    return Path(tempfile.mkdtemp(dir=base))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=("nccl", "ipc"), default="nccl")
    ap.add_argument(
        "--sidecar-gpu",
        default="0",
        help="nccl: CUDA_VISIBLE_DEVICES of the sidecar (this process: its own)",
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reloads", nargs="+", choices=("direct", "layerwise"), default=["direct", "layerwise"])
    ap.add_argument("--out", default="benchmarks/results/weight_transfer.json")
    args = ap.parse_args()

    import torch

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.trainer.state import build_train_state
    from asyncrl.transport.gather import export_model
    from asyncrl.transport.ipc import IPCSender, wait_loaded
    from asyncrl.transport.nccl import NCCLSender, write_manifest
    from asyncrl.transport.streamed import export_entries
    from asyncrl.utils.children import spawn, stop, wait_healthy
    from asyncrl.utils.process import free_port

    model = [SHAPES[args.shape]]
    t0 = time.perf_counter()
    init = compose_config(model).model.init
    root = scratch_root(int(30e9 if args.shape == "4b" else 6e9))
    model_dir = build_tiny_model(init, root / "model", seed=0)
    print(f"built the {args.shape} shape in {time.perf_counter() - t0:.0f}s under {root}", flush=True)
    port, nccl_port = free_port(), free_port()
    overrides = [
        *model,
        f"model.name={model_dir}",
        "inference.backend=vllm",
        f"inference.weights_roots=[{root}]",
        f"weights.transport={args.transport}",
        f"weights.nccl.port={nccl_port}",
        "trainer.fabric.accelerator=cuda",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.precision=bf16-mixed",
        "trainer.fabric.num_threads=0",
        # one GPU shared with this trainer (ipc): vLLM leaves it room
        f"inference.vllm.gpu_memory_utilization={0.5 if args.transport == 'nccl' else 0.35}",
    ]
    cfg = compose_config(overrides)
    sidecar = spawn(
        "sidecar",
        [sys.executable, "-m", "asyncrl", "serve", *overrides, f"inference.port={port}"],
        root / "sidecar.log",
        {
            "CUDA_VISIBLE_DEVICES": args.sidecar_gpu
            if args.transport == "nccl"
            else os.environ.get("CUDA_VISIBLE_DEVICES")
        },
    )
    url = f"http://127.0.0.1:{port}"
    rows: list[dict] = []
    try:
        wait_healthy(sidecar, url, timeout_s=900)
        fabric, raw, tokenizer, _ = build_train_state(cfg, cfg.trainer.optim, cfg.trainer.scheduler, 10)
        sender = shared = None
        if args.transport == "nccl":
            joined: dict = {}
            t = threading.Thread(
                target=post,
                args=(
                    url,
                    "init_weight_transfer",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": nccl_port,
                        "rank_offset": 1,
                        "world_size": 2,
                    },
                    joined,
                ),
            )
            t.start()
            # rank 0 of the group; returns once the sidecar joined
            sender = NCCLSender(cfg, fabric.global_rank)
            t.join()
            assert joined["status"] == 200, joined
        else:
            shared = IPCSender(raw, torch.bfloat16)
        entries = export_entries(raw, torch.bfloat16)
        nbytes = sum(2 * int(torch.Size(shape).numel()) for _, _, shape in entries)
        previous, changed, version = greedy(url), 0, 0
        for r in range(args.repeats + 1):
            with torch.no_grad():  # a new policy: every parameter moves
                for p in raw.parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p  # this rank's FSDP2 shard
                    local.add_(torch.randn_like(local) * 0.02)
            row: dict = {}
            seen: dict[str, list[int]] = {}
            for mode in args.reloads if r % 2 == 0 else args.reloads[::-1]:
                version += 1
                manifest = root / f"step_{version}"
                t0 = time.perf_counter()
                res: dict = {}
                if shared is not None:  # fill the buffer, publish, relay; the sidecar marks it loaded
                    shared.reload = mode
                    shared.publish(raw, manifest, version)
                    sent = time.perf_counter() - t0
                    post(url, "update_weights", {"path": str(manifest), "version": version}, res)
                    wait_loaded(manifest, 60)
                else:
                    assert sender is not None
                    write_manifest(manifest, entries, version, reload=mode)
                    t = threading.Thread(
                        target=post,
                        args=(url, "update_weights", {"path": str(manifest), "version": version}, res),
                    )
                    t.start()
                    sender.send(raw, torch.bfloat16)
                    sent = time.perf_counter() - t0
                    t.join()
                assert res["status"] == 200, res
                worker = res["body"]["workers"][0]
                if worker["reload"] != mode:
                    raise SystemExit(f"asked for reload={mode}, the worker used {worker['reload']}")
                row[mode] = {
                    "s": res["done"] - t0,
                    "trainer_send_s": sent,
                    "sidecar_s": res["body"]["seconds"],
                    "worker_s": worker["seconds"],
                }
                seen[mode] = greedy(url)
                shutil.rmtree(manifest)

            version += 1
            files = root / f"step_{version}"
            t0 = time.perf_counter()
            export_model(fabric, raw, tokenizer, files, "bfloat16")
            t1 = time.perf_counter()
            res = {}
            post(url, "update_weights", {"path": str(files), "version": version}, res)
            assert res["status"] == 200, res
            row["files"] = {"s": res["done"] - t0, "export_s": t1 - t0, "sidecar_s": res["body"]["seconds"]}
            seen["files"] = greedy(url)
            shutil.rmtree(files)
            if len({tuple(v) for v in seen.values()}) != 1:
                raise SystemExit(f"repeat {r}: greedy completions differ between the update paths: {seen}")
            changed += seen["files"] != previous
            previous = seen["files"]
            print(f"repeat {r}: " + ", ".join(f"{k} {v['s']:.3f}s" for k, v in row.items()), flush=True)
            if r:  # the first repeat warms every path up
                rows.append(row)
        if not changed:
            raise SystemExit("the greedy completion never changed: the updates did not reach the sidecar")
    finally:
        stop([sidecar], timeout_s=60)
        shutil.rmtree(root, ignore_errors=True)
    paths = [*args.reloads, "files"]
    med = {p: {k: statistics.median(row[p][k] for row in rows) for k in rows[0][p]} for p in paths}
    base = med["files"]["s"]
    print(f"\n{args.shape} shape over {args.transport}, {nbytes / 1e9:.2f} GB in bf16, medians of {len(rows)} repeats")
    print("| path | median s | sidecar s | worker s | GB/s | vs files |\n|---|---:|---:|---:|---:|---:|")
    for p in paths:
        m = med[p]
        print(
            f"| {p} | {m['s']:.3f} | {m['sidecar_s']:.3f} | {m.get('worker_s', float('nan')):.3f} | "
            f"{nbytes / m['s'] / 1e9:.1f} | {m['s'] / base:.2f} |"
        )
    result = {
        "benchmark": "weight_transfer",
        "command": "python benchmarks/weight_transfer.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "shape": args.shape,
        "transport": args.transport,
        "params": sum(p.numel() for p in raw.parameters()),
        "bytes_sent": nbytes,
        "repeats": rows,
        "median": med,
        "greedy_equal_across_paths": True,
        "greedy_changed_repeats": changed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
