"""The CPU tests that need vLLM installed (not CUDA), run where vLLM is: CI installs no vLLM, so there they
skip, and the GPU scripts run tests/gpu on the machine that has the bundle. pytest collects the test
functions imported here as this module's own, marked `gpu` (tests/static/test_gpu_marks.py checks that every
such test is imported)."""

from __future__ import annotations

import pytest
from integration.test_benchmark_scripts import test_logprobs_transport_replays_vllms_cpu_side
from unit.test_compact_logprobs import test_final_only_rows_read_as_vllms_own_entries
from unit.test_vllm_logprobs import (
    test_bulk_frontend_gives_what_vllms_own_loop_gives,
    test_with_vllms_structs_and_its_message_codec,
)
from unit.test_vllm_worker import test_receive_direct_through_vllms_consumer

pytestmark = pytest.mark.gpu

__all__ = [
    "test_bulk_frontend_gives_what_vllms_own_loop_gives",
    "test_final_only_rows_read_as_vllms_own_entries",
    "test_logprobs_transport_replays_vllms_cpu_side",
    "test_receive_direct_through_vllms_consumer",
    "test_with_vllms_structs_and_its_message_codec",
]
