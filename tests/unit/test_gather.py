"""The bucketed gather of FSDP2 shards (transport/gather.py), on two CPU processes (gloo): every tensor comes
back exactly as the unsharded model holds it, cast to the asked dtype, whatever the bucket size and however
unevenly dim 0 splits (rows that do not divide by the ranks, a rank holding no rows, 1-D and 3-D tensors)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.utils.process import free_port


class Uneven(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(103, 8)  # 52 + 51 rows
        self.proj = torch.nn.Linear(8, 5)  # 3 + 2 rows
        self.norm = torch.nn.LayerNorm(8)  # 1-D
        self.head = torch.nn.Linear(3, 1)  # 1 + 0 rows: rank 1 holds none
        # a mixture of experts' fused experts, [experts, 2 x intermediate, hidden]: 2 + 1 experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 4, 8))


BUCKETS = [1 << 30, 64]  # everything in one bucket; one tensor per bucket


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Uneven().state_dict().items()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncrl.transport import gather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Uneven()
        mesh = init_device_mesh("cpu", (2,))
        for m in (model.embed, model.proj, model.norm, model.head):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for bucket_bytes in BUCKETS:
            gather.BUCKET_BYTES = bucket_bytes
            got = {str(dtype): dict(gather.iter_full(model, dtype)) for dtype in (torch.bfloat16, None)}
            only = dict(gather.iter_full(model, None, only=lambda n: n.startswith("proj")))
            torch.save({"got": got, "only": only}, f"{out_dir}/rank{rank}_{bucket_bytes}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """Both ranks' gathers at every bucket size, from one pair of processes (each imports torch: seconds of
    CPU apiece)."""
    out = tmp_path_factory.mktemp("gather")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    return out


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_bucketed_gather_returns_the_unsharded_tensors(gathered, bucket_bytes):
    ref = reference()
    for rank in (0, 1):
        res = torch.load(gathered / f"rank{rank}_{bucket_bytes}.pt")
        bf16, own = res["got"]["torch.bfloat16"], res["got"]["None"]
        assert list(bf16) == list(ref) == list(own)  # state_dict order
        for name, full in ref.items():
            assert own[name].dtype == full.dtype and torch.equal(own[name], full), name
            assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], full.to(torch.bfloat16)), (
                name
            )
        assert list(res["only"]) == ["proj.weight", "proj.bias"]
