"""GPU layouts (config/layout.py): the presets in conf/layout/ compose and add up; a layout that does not add
up is refused naming the keys; the launcher refuses GPUs the node lacks."""

import pytest

from asyncrl.config import ConfigError, inference_workers
from asyncrl.config.compose import compose_config
from asyncrl.config.layout import gpu_list, gpu_owners, missing_gpus
from asyncrl.inference.vllm.server import vllm_cli_args
from asyncrl.launcher import preflight
from asyncrl.paths import CONF_DIR

VLLM = ["inference.backend=vllm", "trainer.fabric.accelerator=cuda"]
PRESETS = sorted(p.stem for p in (CONF_DIR / "layout").glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_adds_up(name):
    """Each preset names every GPU of its node once (the 1-GPU one shares GPU 0 on purpose), each replica
    tensor_parallel GPUs, and the trainer `devices` GPUs."""
    cfg = compose_config([f"layout={name}"])
    inf, fab = cfg.inference, cfg.trainer.fabric
    node = int(name.split("gpu")[0])
    named = [g for e in inf.gpus for g in gpu_list(e)] + gpu_list(fab.gpus)
    assert sorted(set(named), key=int) == [str(i) for i in range(node)]
    assert len(named) == node or inf.share_gpus
    assert all(len(gpu_list(e)) == inf.tensor_parallel for e in inf.gpus)
    assert len(gpu_list(fab.gpus)) == fab.devices
    assert inference_workers(cfg) == len(inf.gpus) * inf.tensor_parallel


def test_tensor_parallel_reaches_vllm():
    cfg = compose_config(["layout=4gpu_tp2"])
    args = vllm_cli_args(cfg, 8000)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_cli_args(compose_config(["layout=4gpu_2replicas"]), 8000)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["inference.gpus=['0,1','2']", "inference.tensor_parallel=2"],
         "inference.gpus[1]='2' names 1 GPU(s) but each replica takes 2"),
        (["inference.gpus=['0']", "inference.vllm.extra_args=[--data-parallel-size,2]"],
         "inference.gpus[0]='0' names 1 GPU(s) but each replica takes 2"),
        (["inference.vllm.extra_args=[--tensor-parallel-size,2]"],
         "extra_args sets --tensor-parallel-size: set inference.tensor_parallel instead"),
        (["inference.vllm.extra_args=['-tp=2']"], "extra_args sets -tp"),
        (["inference.gpus=['0','0']"],
         "GPU 0 is named by inference.gpus[0] and inference.gpus[1]: set inference."),
        (["inference.gpus=['0,0']", "inference.tensor_parallel=2"],
         "GPU 0 appears twice in inference.gpus[0]"),
        (["inference.gpus=['0']", "trainer.fabric.gpus='0'"],
         "GPU 0 is named by inference.gpus[0] and trainer.fabric.gpus: set inference.share_gpus=true"),
        (["inference.gpus=['1']", "trainer.fabric.gpus='0,0'", "trainer.fabric.devices=2"],
         "GPU 0 appears twice in trainer.fabric.gpus"),
        (["inference.gpus=['0']", "trainer.fabric.gpus='1'", "distill.teacher=t", "distill.gpus='1'"],
         "GPU 1 is named by trainer.fabric.gpus and distill.gpus"),
        (["inference.vllm.extra_args=[--headless]"], "vLLM's multi-node data parallelism"),
    ],
)  # fmt: skip
def test_a_layout_that_does_not_add_up_is_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        compose_config([*VLLM, *overrides])
    assert message in str(e.value)


def test_sharing_on_purpose_and_unpinned_sidecars_are_fine():
    compose_config([*VLLM, "inference.gpus=['0']", "trainer.fabric.gpus='0'", "inference.share_gpus=true"])
    compose_config(["inference.gpus=['','']"])  # two CPU sidecars, no GPU named
    with pytest.raises(ConfigError, match="inference.tensor_parallel=2 needs inference.backend=vllm"):
        compose_config(["inference.tensor_parallel=2"])


def test_the_launcher_refuses_gpus_the_node_lacks(monkeypatch):
    cfg = compose_config(["layout=4gpu_tp2"])
    assert missing_gpus(cfg, 4) == [] and missing_gpus(cfg, 2) == ["2", "3"]
    assert gpu_owners(cfg)["3"] == ["trainer.fabric.gpus"]
    monkeypatch.setattr(preflight, "gpu_count", lambda: 2)
    (problem,) = preflight.layout_problems(cfg)
    assert (
        "this node has 2 GPU(s)" in problem
        and "GPU 2 by trainer.fabric.gpus; GPU 3 by trainer.fabric.gpus" in problem
    )
    monkeypatch.setattr(preflight, "gpu_count", lambda: None)  # no nvidia-smi: CUDA reports it at start
    assert preflight.layout_problems(cfg) == []
