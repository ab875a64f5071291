"""trainer.profile_step's overlap summary: the GPU time FSDP2's collectives leave uncovered, from a Chrome
trace."""

from __future__ import annotations

import pytest

from asyncrl.trainer.profile import overlap_summary


def kernel(name: str, stream: int, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_collectives_hidden_by_computation_are_not_exposed():
    trace = {
        "traceEvents": [
            kernel("sm90_xmma_gemm", 7, 0, 100),
            kernel("ncclDevKernel_AllGather_RING_LL", 20, 10, 50),  # under the matmul: hidden
            kernel("void at::native::chunk_cat_cuda_kernel", 20, 60, 10),  # FSDP2's copy: computation
            # the gradient norm's, on the compute stream
            kernel("ncclDevKernel_AllReduce_Sum_f32", 7, 225, 5),
            kernel("flash_fwd", 7, 150, 50),
            kernel("ncclDevKernel_ReduceScatter_Sum", 21, 180, 40),  # 20 of its 40 us past the compute
            kernel("Memcpy DtoH", 7, 230, 5, cat="gpu_memcpy"),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host side: not GPU time
        ]
    }
    s = overlap_summary(trace)
    assert s["compute_s"] == pytest.approx(155e-6)  # the copy runs under the matmul
    assert s["comm_s"] == pytest.approx(95e-6)
    assert s["exposed_comm_s"] == pytest.approx(25e-6)
    assert s["gpu_busy_s"] == pytest.approx(180e-6)
    assert s["gpu_span_s"] == pytest.approx(235e-6)


def test_without_collectives_every_kernel_is_computation():
    s = overlap_summary({"traceEvents": [kernel("gemm", 7, 0, 10), kernel("gemm", 8, 5, 10)]})
    assert (s["compute_s"], s["comm_s"], s["exposed_comm_s"]) == pytest.approx((15e-6, 0.0, 0.0))
    assert overlap_summary({"traceEvents": []})["gpu_span_s"] == 0.0
