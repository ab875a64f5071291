"""Packed-row causal attention kernels, forward and forward + backward, on the Qwen3-0.6B attention shape.

Which attention is fastest on this GPU (flash-attn where it wins against torch's varlen kernel, and whether
the image needs it at all). Each kernel gets the same packed stream of samples (lengths as ``trainer_mfu.py``
packs them, 65-2,047 tokens, into rows of ``--tokens``), bf16, 16 query heads sharing 8 key/value heads, head
dim 128:

  torch_varlen   asyncrl's ``varlen`` attention (``asyncrl.models.attention.packed_attention``): torch's own
                 FlashAttention-2 kernel (``torch.nn.attention.varlen``)
  flash_attn2    the ``flash-attn`` package (``flash_attn_varlen_func``), what the gpu image builds
  flash_attn4    ``flash-attn-4`` (``flash_attn.cute``, CuTe DSL kernels for Hopper and Blackwell), as
                 transformers' ``flash_attention_4`` calls it
  fa4_ops        the same kernels as asyncrl's ``varlen_fa4`` calls them: torch custom ops (models/fa4.py)

A kernel whose package is missing is reported as such. Each is checked against ``torch_varlen`` (largest
absolute difference of the output and of the query gradient) and against the exact answer (causal attention
per sample in fp32 from the same bf16 inputs: largest difference relative to the largest value,
``rel_err_*``; a kernel's ``rel_err`` far above torch_varlen's is a wrong result, not rounding), then timed
with CUDA events (median of ``--repeats`` after warm-up). Prints a table and writes JSON.

    python benchmarks/attention_kernels.py --out $OUT/attention_kernels.json

On the lent GPU, flash-attn-4 comes from ``benchmarks/device_wheels.sh -o .whl-fa4 fa4``: two pieces,
``.whl-fa4.part1`` and ``.whl-fa4.part2``, carried in two calls to the same warm machine (beside other work);
``. benchmarks/device_env.sh`` installs them once both are there. Leave the vLLM bundle out of the call that
runs this, or put the extras first where the bundle was unpacked earlier (its apache-tvm-ffi is older than
flash-attn-4 needs): ``PYTHONPATH=/tmp/extra:$PYTHONPATH python benchmarks/attention_kernels.py ...``.
    python benchmarks/attention_kernels.py --device cpu --tokens 512 --kernels torch_varlen   # the script,
    on CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from _results import stamped, write_results

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B


def lengths(tokens: int, seed: int = 0) -> list[int]:
    """Sample lengths filling ``tokens`` (the last one cut to fit), as trainer_mfu.py's packing makes
    them."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(65, 2048, (1,), generator=g)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def kernels() -> dict:
    """name -> callable(q, k, v, cu, max_len) -> out ``[T, HQ, D]``, or the reason it is unavailable."""
    from asyncrl.models.attention import packed_attention

    found: dict = {"torch_varlen": lambda q, k, v, cu, m: packed_attention(q, k, v, cu, m)}
    try:
        from flash_attn import flash_attn_varlen_func as fa2

        found["flash_attn2"] = lambda q, k, v, cu, m: fa2(q, k, v, cu, cu, m, m, causal=True)
    except ImportError as e:
        found["flash_attn2"] = f"not installed ({e})"
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4

        def flash_attn4(q, k, v, cu, m):
            out = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True)
            return out[0] if isinstance(out, tuple) else out

        found["flash_attn4"] = flash_attn4
    except ImportError as e:
        found["flash_attn4"] = f"not installed ({e})"
    from asyncrl.models import fa4 as fa4_ops

    try:
        fa4_ops.check_installed()
        found["fa4_ops"] = lambda q, k, v, cu, m: fa4_ops.packed_attention_fa4(q, k, v, cu, m)
    except RuntimeError as e:
        found["fa4_ops"] = str(e)
    return found


def exact(q, k, v, cu, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each packed sample in fp32 (the bf16 inputs upcast), and the query gradient for
    ``grad``."""
    from asyncrl.models.attention import per_sample_attention

    q32, k32, v32 = (x.detach().float() for x in (q, k, v))
    q32.requires_grad_(True)
    out = per_sample_attention(q32, k32, v32, cu)
    out.backward(grad.float())
    return out.detach(), q32.grad.detach()


def rel_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest absolute difference from ``truth``, relative to ``truth``'s largest magnitude."""
    return float((x.float() - truth).abs().max() / truth.abs().max())


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
        if i >= 2:
            times.append(dt)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the packed stream")
    ap.add_argument("--kernels", nargs="+", default=["torch_varlen", "flash_attn2", "flash_attn4"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/attention_kernels.json"))
    args = ap.parse_args()
    dev, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    lens = lengths(args.tokens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    max_len = max(lens)
    # causal attention FLOPs: 2 matmuls of 2*len^2*D per head, halved by the mask; backward 2.5x the forward
    fwd_flops = sum(2 * 2 * n * n * D * HQ / 2 for n in lens)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(args.tokens, h, D, device=dev, dtype=dtype, generator=g) for h in (HQ, HKV, HKV))
    grad = torch.randn(args.tokens, HQ, D, device=dev, dtype=dtype, generator=g)
    found = kernels()
    truth = exact(q, k, v, cu, grad)
    ref = None
    rows = []
    for name in args.kernels:
        fn = found.get(name, f"unknown kernel (have: {', '.join(found)})")
        if isinstance(fn, str):
            rows.append({"kernel": name, "error": fn})
            print(f"{name:<14} {fn}", flush=True)
            continue
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        try:
            out = fn(qq, kk, vv, cu, max_len)
            out.backward(grad)
        # a kernel that cannot run this shape on this GPU: reported, the others still run
        except Exception as e:
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{name:<14} failed: {rows[-1]['error']}", flush=True)
            continue
        if ref is None:  # copies: the timed steps below run backward on these leaves again
            ref = (out.detach().clone(), qq.grad.detach().clone())
        diff_out = float((out.detach().float() - ref[0].float()).abs().max())
        diff_grad = float((qq.grad.float() - ref[1].float()).abs().max())
        err_out, err_grad = rel_err(out.detach(), truth[0]), rel_err(qq.grad, truth[1])

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v, cu, max_len)

        def train_step(fn=fn, qq=qq, kk=kk, vv=vv):
            # a fresh gradient each step, as in training, not a sum into .grad
            qq.grad = kk.grad = vv.grad = None
            fn(qq, kk, vv, cu, max_len).backward(grad)

        fwd_s, step_s = timed(forward, args.repeats, dev), timed(train_step, args.repeats, dev)
        rows.append(
            {
                "kernel": name,
                "forward_s": fwd_s,
                "forward_backward_s": step_s,
                "forward_tflops": fwd_flops / fwd_s / 1e12,
                "forward_backward_tflops": 3.5 * fwd_flops / step_s / 1e12,
                "max_abs_diff_out": diff_out,
                "max_abs_diff_grad_q": diff_grad,
                "rel_err_out": err_out,
                "rel_err_grad_q": err_grad,
            }
        )
        print(
            f"{name:<14} fwd {1e3 * fwd_s:8.3f} ms ({rows[-1]['forward_tflops']:6.1f} TFLOP/s)  fwd+bwd "
            f"{1e3 * step_s:8.3f} ms ({rows[-1]['forward_backward_tflops']:6.1f} TFLOP/s)  "
            f"|diff| out {diff_out:.2e} grad_q {diff_grad:.2e}  "
            f"rel err vs fp32 out {err_out:.1e} grad_q {err_grad:.1e}",
            flush=True,
        )
    base = next((r for r in rows if r["kernel"] == "torch_varlen" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["speedup_forward_backward_vs_torch_varlen"] = base["forward_backward_s"] / r["forward_backward_s"]
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    write_results(
        args.out,
        stamped(
            "attention_kernels",
            device=device,
            torch=torch.__version__,
            shape={
                "tokens": args.tokens,
                "samples": len(lens),
                "heads_q": HQ,
                "heads_kv": HKV,
                "head_dim": D,
            },
            results=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
