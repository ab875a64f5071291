"""Hashes of the CPU kernels ``numerics=reproducible`` pins, to compare two machines bit for bit.

``asyncrl.numerics`` rests on these claims: under its pins (AVX2 ATen, ``MKL_CBWR=COMPATIBLE``, a fixed
thread count) MKL's GEMMs and the VML functions it does not list in ``VML_AVOID`` give the same bits on an
Intel and an AMD CPU, and ``torch.sqrt`` on CPU is not correctly rounded. Run this on each machine, with
the same ``--threads``, and compare the outputs: every line but the first (the CPU) must be equal, except
the ops in ``VML_AVOID``::

    python benchmarks/vml_agreement.py --threads 1 > a.txt    # on each machine, then: diff a.txt b.txt

The last line counts the float32 square roots that differ from numpy's (IEEE, correctly rounded).
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

from asyncrl import numerics

OPS = ("exp", "log", "tanh", "sin", "cos", "expm1", "log1p", "log2", "erf", "atan", *numerics.VML_AVOID)


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch and MKL threads (compare equal counts only)")
    ap.add_argument("--n", type=int, default=100_000, help="inputs per op")
    args = ap.parse_args()
    numerics.apply("reproducible", args.threads)  # the pins are read when torch loads: set them first
    import torch  # lazy: after numerics.apply, which must run before torch loads

    numerics.configure_torch("reproducible", args.threads)
    print("cpu", numerics.cpu_info()["model"])
    g = torch.Generator().manual_seed(0)
    for rows in (*range(1, 33), 64, 256):
        for inner in (64, 1000):
            x, w = torch.randn(rows, inner, generator=g), torch.randn(inner, 128, generator=g)
            print(f"gemm rows={rows} inner={inner}", digest(x @ w))
    for dtype in (torch.float32, torch.float64):
        # (0, 1) for the inverse trigonometric ops' domain, scaled up to 10 for the rest
        x = torch.rand(args.n, generator=g, dtype=dtype).clamp_min(1e-6)
        for op in OPS:
            arg = x if op in ("acos", "asin", "erfinv") else x * 10
            print(f"{op} {dtype}", digest(getattr(torch, op)(arg)))
    x = torch.rand(args.n, generator=g) * 10
    wrong = (torch.sqrt(x).numpy() != np.sqrt(x.numpy())).mean()
    print(f"sqrt float32 not correctly rounded: {wrong:.1%}")


if __name__ == "__main__":
    main()
