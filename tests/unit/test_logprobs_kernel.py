"""inference.vllm.logprobs_kernel: which steps the one-kernel path takes (the sampled token's logprob only,
one a request, logprobs not logits) and which go to vLLM's ``compute_topk_scores`` with their arguments
untouched; a vLLM it was not written for is refused by name; the packed array comes back as vLLM's three
fields, copied once. The kernel's numbers against vLLM's are the GPU test's
(``test_logprobs_kernel_equals_vllms``)."""

from __future__ import annotations

import types
from typing import NamedTuple

import numpy as np
import pytest
import torch

from asyncrl.inference.vllm import sampled


class Tensors(NamedTuple):  # vllm.v1.outputs.LogprobsTensors' fields and the methods the output copier calls
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    cu_num_generated_tokens: list[int] | None = None

    def to_cpu_nonblocking(self):  # vLLM 0.26's: a copy a field
        return Tensors(*(t.to("cpu", non_blocking=True) for t in self[:3]), self.cu_num_generated_tokens)

    def tolists(self):
        return tuple(t.cpu().numpy() for t in self[:3])


def compute_topk_scores(  # vLLM 0.26's parameters; records its call
    logits,
    num_logprobs,
    sampled_token_ids,
    cu_num_logits=None,
    logprob_token_ids_state=None,
    expanded_idx_mapping=None,
    max_per_req_token_ids=0,
    logits_mode=False,
):
    return ("vllm", num_logprobs, cu_num_logits, logprob_token_ids_state, max_per_req_token_ids, logits_mode)


def sampler_module() -> types.ModuleType:
    module = types.ModuleType(sampled.SAMPLER)
    module.compute_topk_scores = compute_topk_scores
    module.LogprobsTensors = Tensors
    return module


def test_only_the_sampled_tokens_logprobs_take_the_kernel(monkeypatch):
    module = sampler_module()
    monkeypatch.setattr(sampled, "sampled_logprobs", lambda logits, ids, tensors: ("kernel", tensors))
    sampled.install(module, "0.26.0")
    f, logits, ids = module.compute_topk_scores, torch.zeros(4, 10), torch.zeros(4, dtype=torch.int64)
    # the V2 sampler's call, keywords after the first four
    call = dict(
        logprob_token_ids_state="s", expanded_idx_mapping="m", max_per_req_token_ids=0, logits_mode=False
    )
    assert f(logits, 0, ids, None, **call) == ("kernel", Tensors)
    assert f(logits, 2, ids, None, **call) == ("vllm", 2, None, "s", 0, False)  # top-k logprobs too
    assert f(logits, 0, ids, [0, 2, 4], **call)[0] == "vllm"  # several tokens a request
    assert f(logits, 0, ids, None, **{**call, "max_per_req_token_ids": 3})[4] == 3  # chosen ids' logprobs
    assert f(logits, 0, ids, None, **{**call, "logits_mode": True})[5] is True  # logits, not logprobs
    assert f(torch.zeros(0, 10), 0, ids[:0], None, **call)[0] == "vllm"  # an empty batch
    assert f(logits, 0, ids, None, "s", "m", 3, False)[4] == 3  # positional arguments read alike
    assert f(logits, 0, ids)[0] == "kernel"
    sampled.install(module, "0.26.0")  # idempotent: the wrapper is not wrapped again
    assert module.compute_topk_scores is f


@pytest.mark.parametrize(
    ("version", "change", "why"),
    [
        ("0.27.0", None, "written for vLLM 0.26.x, this is vLLM 0.27.0"),
        ("0.26.1", "drop", "does not import"),
        ("0.26.0", "rename", "takes ("),
    ],
)
def test_a_vllm_it_was_not_written_for_is_refused_by_name(version, change, why):
    module = sampler_module()
    if change == "drop":
        del module.compute_topk_scores
    elif change == "rename":
        module.compute_topk_scores = (
            lambda logits, k, ids, cu=None, state=None, mapping=None, per_req=0, mode=0: 0
        )
    with pytest.raises(RuntimeError, match="inference.vllm.logprobs_kernel=true: ") as e:
        sampled.install(module, version)
    assert why in str(e.value) and "inference.vllm.logprobs_kernel=false" in str(e.value)
    assert not getattr(module, "_asyncrl_logprobs_kernel", False)


def test_the_packed_array_is_vllms_three_fields_and_copies_once(monkeypatch):
    logprobs = np.array([-0.5, -3.25, -1e-7], np.float32)
    packed = torch.tensor(np.stack([[7, 0, 151935], logprobs.view(np.int32), [1, 40, 1]]).astype(np.int32))
    out = sampled._packed_class(Tensors)(*sampled.unpack(packed, Tensors), packed=packed)
    assert isinstance(out, Tensors) and out.cu_num_generated_tokens is None
    assert out.logprob_token_ids.tolist() == [[7], [0], [151935]] and out.selected_token_ranks.tolist() == [
        1,
        40,
        1,
    ]
    assert out.logprobs.dtype == torch.float32 and out.logprobs[:, 0].numpy().tobytes() == logprobs.tobytes()
    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(a) or real_to(self, *a, **k))
    ids, lps, ranks = out.to_cpu_nonblocking().tolists()
    assert len(copies) == 1  # one array to the host, not three
    assert ids.tolist() == [[7], [0], [151935]] and lps[:, 0].tobytes() == logprobs.tobytes()
    assert ranks.tolist() == [1, 40, 1] and lps.shape == (3, 1)


def test_covers_names_every_condition():
    assert sampled.covers(0, None, 0, False, 1)
    for args in (
        (1, None, 0, False, 1),
        (0, [0, 1], 0, False, 1),
        (0, None, 2, False, 1),
        (0, None, 0, True, 1),
        (0, None, 0, False, 0),
    ):
        assert not sampled.covers(*args), args
