"""The Triton kernel of :mod:`asyncrl.inference.vllm.sampled`, apart because it imports Triton (GPU machines
only) at the top: Triton resolves the names a kernel uses (``tl``) among its module's globals."""

import triton
import triton.language as tl


@triton.jit
def sampled_logprob_kernel(
    out_ptr,
    rows,
    logits_ptr,
    logits_stride,
    token_ids_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
    RANKS: tl.constexpr,
):
    # one program a row: the sampled token's id, logprob (float32 bits) and rank into out_ptr (int32 [3,
    # rows])
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    # vLLM 0.26's _topk_log_softmax_kernel, op for op: the same max, the same sum in the same order
    max_val = float("-inf")
    for i in range(0, vocab_size, BLOCK):
        block = i + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + block, mask=block < vocab_size, other=float("-inf"))
        max_val = tl.max(tl.maximum(logits, max_val))
    max_val = max_val.to(tl.float32)  # type: ignore[attr-defined]
    se = 0.0
    for i in range(0, vocab_size, BLOCK):
        block = i + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + block, mask=block < vocab_size, other=0.0)
        logits = logits.to(tl.float32)
        e = tl.exp(logits - max_val)
        e = tl.where(block < vocab_size, e, 0.0)
        se += tl.sum(e)
    lse = tl.log(se)
    token_id = tl.load(token_ids_ptr + row)
    x = tl.load(row_ptr + token_id)
    logprob = x.to(tl.float32) - max_val - lse
    # vLLM 0.26's _ranks_kernel: the ids scoring at least the sampled one, the sampled one included
    n = 0
    for i in range(0, vocab_size, RANKS):
        block = i + tl.arange(0, RANKS)
        logits = tl.load(row_ptr + block, mask=block < vocab_size, other=float("-inf"))
        n += tl.sum((logits >= x).to(tl.int32))
    tl.store(out_ptr + row, token_id.to(tl.int32))
    tl.store(out_ptr + rows + row, logprob.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2 * rows + row, n)
