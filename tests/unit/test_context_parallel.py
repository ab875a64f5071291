"""Context parallelism's bookkeeping (trainer/context.py) on two CPU processes (gloo): torch's context shards
a row's buffers, each rank scores its positions against the whole row's next tokens, and the logprobs, loss
masks and gradients of the two ranks add up to the unsharded row's. A per-token model (embeddings and a head,
no attention) isolates that bookkeeping: torch's ring attention itself replaces only SDPA's CUDA kernels, so
it runs in the GPU test (tests/gpu/test_context_parallel.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.utils.process import free_port

B, T, V = 2, 16, 40


class PerToken(torch.nn.Module):
    """Logits of each position from its token and its position only, like an HF causal LM's call
    signature."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.head = (
            torch.nn.Embedding(V, 8),
            torch.nn.Embedding(T, 8),
            torch.nn.Linear(8, V),
        )

    def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False):
        assert attention_mask is not None and bool(attention_mask.all())
        return SimpleNamespace(logits=self.head(self.embed(input_ids) + self.pos(position_ids)))


def micro_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "position_ids": torch.arange(T).expand(B, T).contiguous(),
        "temperatures": torch.rand(B, T, generator=g) + 0.5,
        "loss_mask": torch.rand(B, T, generator=g) > 0.3,
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    from asyncrl.models.logprobs import chunked_logprobs
    from asyncrl.trainer.context import ContextParallel, sharded_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model, mb = PerToken(), micro_batch()
        full = chunked_logprobs(model(**{k: mb[k] for k in ("input_ids", "position_ids")},
                                      attention_mask=torch.ones_like(mb["input_ids"])).logits,
                                mb["input_ids"], mb["temperatures"])  # fmt: skip
        (full * mb["loss_mask"][:, 1:]).sum().backward()
        full_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        cp = ContextParallel(2, SimpleNamespace(world_size=2, device=torch.device("cpu")))
        with cp.shard(mb) as local:
            assert local["input_ids"].shape == (B, T // 2)
            lp = sharded_logprobs(model, local)
            (lp * local["loss_mask"][:, 1:]).sum().backward()
            mask, index = local["loss_mask"], local["index"]
        scored = lp.detach() * mask[:, 1:]
        grads = [p.grad.clone() for p in model.parameters()]
        for t in (scored, mask_sum := mask.long(), *grads):
            dist.all_reduce(t)
        torch.save(
            {
                "full": full.detach() * mb["loss_mask"][:, 1:],
                "scored": scored,
                "mask": mask_sum,
                "full_mask": mb["loss_mask"].long(),
                "index": index,
                "full_grads": full_grads,
                "grads": grads,
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_score_the_row_as_one(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # head and tail: each rank holds two chunks of T/4, together every position once
    assert sorted(torch.cat([r0["index"][0], r1["index"][0]]).tolist()) == list(range(T))
    assert r0["index"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    for r in (r0, r1):
        torch.testing.assert_close(r["scored"], r["full"])  # every loss token scored by exactly one rank
        assert torch.equal(r["mask"][:, 1:], r["full_mask"][:, 1:]) and not r["mask"][:, 0].any()
        for g, full in zip(r["grads"], r["full_grads"], strict=True):
            torch.testing.assert_close(g, full)


def test_config_refuses_what_context_parallelism_does_not_run_with():
    gpu = [
        "trainer.fabric.accelerator=cuda",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.devices=2",
        "trainer.fabric.gpus='0,1'",
        "inference.backend=vllm",
        "model.attn_implementation=sdpa",
        "seq_len=512",
        "trainer.fabric.context_parallel=2",
    ]
    compose_config(gpu)
    compose_config([*gpu, "model.attn_implementation=auto"])  # resolves to sdpa under context parallelism
    for extra, message in [
        (["model.attn_implementation=varlen"], "needs model.attn_implementation=sdpa"),
        (["trainer.fabric.context_parallel=3"], "must divide the trainer's ranks"),
        (
            ["seq_len=510", "orchestrator.max_tokens=100"],
            "seq_len=510 must be a multiple of 2 x context_parallel",
        ),
        (["trainer.loss.type=gspo"], "gspo"),
        (["trainer.fabric.compile=true"], "compile"),
    ]:
        try:
            compose_config([*gpu, *extra])
        except ConfigError as e:
            assert message in str(e), (extra, str(e))
        else:
            raise AssertionError(f"{extra} was accepted")
