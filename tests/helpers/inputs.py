"""Inputs that several tests build: sampling parameters that stop samples on different steps, packed rows."""

from __future__ import annotations

from pathlib import Path


def staggered_sampling(model: Path | str, n: int = 8) -> dict:
    """``sampling_params`` for ``/inference/v1/generate`` under which a request's ``n`` samples stop on
    different steps, for a random-init model with the char tokenizer (its distribution is near uniform; half
    the letters are stop tokens; vLLM takes temperatures up to 2, so a trained model would sample much the
    same). vLLM 0.26's token route left the samples that finished first out of such a request's answer,
    unless it was final-only (``asyncrl.inference.vllm.server.final_only_unless_streamed``)."""
    from transformers import AutoTokenizer  # torch-free module: conftest imports it before numerics.apply

    stops = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids(list("nopqrstuvwxyz"))
    return {"n": n, "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1, "stop_token_ids": stops}


def two_packed_rows() -> dict:
    """A micro-batch of 2 packed rows of 12 tokens (samples of 5 + 7 and 3 + 9), for ``packed_logprobs``."""
    import torch  # torch-free module: conftest imports it before numerics.apply

    pos = torch.stack(
        [torch.cat([torch.arange(5), torch.arange(7)]), torch.cat([torch.arange(3), torch.arange(9)])]
    )
    return {
        "input_ids": torch.randint(6, 30, (2, 12)),
        "position_ids": pos,
        "temperatures": torch.ones(2, 12),
    }
