"""asyncrl's vLLM worker extension: which reload a broadcast gets, the unloaded-parameter check, and the
direct receive driven through vLLM's own packed consumer (CUDA streams and the NCCL group stood in for: the
GPU half runs in tests/gpu, test_rl_nccl_transport_two_gpus and benchmarks/weight_transfer.py)."""

import contextlib

import pytest
import torch

from asyncrl.inference.vllm.worker import WeightReceiver, missing_parameters, moe_backends, reload_mode
from asyncrl.transport.base import Transport
from asyncrl.transport.nccl import receive_direct


def test_reload_mode():
    assert reload_mode("direct", quantized=False, cuda=True) == "direct"
    # quantized layers need vLLM's processing after loading; CPU layers are repacked after loading
    assert reload_mode("direct", quantized=True, cuda=True) == "layerwise"
    assert reload_mode("direct", quantized=False, cuda=False) == "layerwise"
    assert reload_mode("layerwise", quantized=False, cuda=True) == "layerwise"
    # a mixture of experts: direct only where every expert layer's kernel reads the layout its loader writes
    assert reload_mode("direct", False, True, frozenset({"TRITON"})) == "direct"
    assert reload_mode("direct", False, True, frozenset({"TRITON", "FLASHINFER_CUTLASS"})) == "layerwise"
    assert reload_mode("direct", False, True, frozenset({"?"})) == "layerwise"
    with pytest.raises(ValueError, match="direct"):
        reload_mode("fast", quantized=False, cuda=True)


def test_missing_parameters():
    assert missing_parameters({"a", "b"}, {"a", "b", "c"}) == []
    assert missing_parameters({"a", "b", "z"}, {"a"}) == ["b", "z"]
    # vLLM's MoERunner answers its experts' names without the routed_experts child they are registered under
    experts = "model.layers.0.mlp.experts"
    params = {
        f"{experts}.routed_experts.w13_weight",
        f"{experts}.routed_experts.w2_weight",
        "model.norm.weight",
    }
    assert (
        missing_parameters(params, {f"{experts}.w13_weight", f"{experts}.w2_weight", "model.norm.weight"})
        == []
    )
    assert missing_parameters(params, {f"{experts}.w13_weight", "model.norm.weight"}) == [
        f"{experts}.w2_weight"
    ]


def test_moe_backends():
    """The kernels of a model's expert layers, read as vLLM 0.26 holds them: a RoutedExperts module with a
    ``w13_weight`` and a ``quant_method`` (UnquantizedFusedMoEMethod,
    fused_moe/unquantized_fused_moe_method.py line 53: ``unquantized_backend``, an UnquantizedMoeBackend
    enum), possibly wrapped by FusedMoEModularMethod (fused_moe/fused_moe_modular_method.py line 43:
    ``old_quant_method``)."""
    import enum
    from types import SimpleNamespace

    Backend = enum.Enum(
        "UnquantizedMoeBackend", {"TRITON": "TRITON", "FLASHINFER_CUTLASS": "FlashInfer CUTLASS"}
    )

    class Experts(torch.nn.Module):
        def __init__(self, method):
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3))
            self.quant_method = method

    triton = SimpleNamespace(unquantized_backend=Backend.TRITON)
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), Experts(triton)])
    assert moe_backends(torch.nn.Linear(2, 2)) == frozenset()
    assert moe_backends(model) == {"TRITON"}
    wrapped = SimpleNamespace(
        old_quant_method=SimpleNamespace(unquantized_backend=Backend.FLASHINFER_CUTLASS)
    )
    model.append(Experts(wrapped))
    model.append(Experts(SimpleNamespace()))  # a quantized method names no unquantized backend
    assert moe_backends(model) == {"TRITON", "FLASHINFER_CUTLASS", "?"}


def test_receive_direct_through_vllms_consumer(monkeypatch):
    """Several buckets (a 20-byte buffer), each loaded by the model before the next arrives: every tensor
    lands whole, in order, and the names loaded are reported."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    class Stream:
        def synchronize(self):
            pass

    # vLLM's consumer runs each bucket on a CUDA stream; on the CPU they are stood in for
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)

    sent = {
        f"w{i}": torch.arange(i * 10, i * 10 + 3 + i, dtype=torch.float32).to(torch.bfloat16)
        for i in range(6)
    }
    size = 20
    items = iter(sent.items())
    # what the trainer's side broadcasts, packed by vLLM's producer code with the same buffer size
    chunks = []
    while (chunk := pack_tensors(items, lambda x: x[1], size)) is not None:
        chunks.append(chunk.packed_tensor)

    class Group:
        def broadcast(self, buf, src):
            assert src == 0
            buf.copy_(chunks.pop(0))

    class Engine:
        model_update_group = Group()
        device = "cpu"

        def parse_update_info(self, d):
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

            return NCCLWeightTransferUpdateInfo(**d)

    class Model:
        def __init__(self):
            self.params = {n: torch.zeros_like(t) for n, t in sent.items() if n != "w5"}  # w5: not served
            self.calls = 0

        def load_weights(self, weights):
            self.calls += 1
            done = set()
            for name, t in weights:
                if name in self.params:
                    self.params[name].copy_(t)
                    done.add(name)
            return done

    model = Model()
    info = {
        "names": list(sent),
        "dtype_names": ["bfloat16"] * len(sent),
        "shapes": [list(t.shape) for t in sent.values()],
        "packed": True,
        "packed_buffer_size_bytes": size,
    }
    loaded = receive_direct(Engine(), model, info)
    assert not chunks and model.calls > 2  # every bucket received, several of them
    assert loaded == set(model.params)
    for name, t in model.params.items():
        assert torch.equal(t, sent[name]), name
    with pytest.raises(ValueError, match="packed"):
        receive_direct(Engine(), model, {**info, "packed": False})


class Handed(Transport):
    """A transport whose manifest carries the values themselves (one per parameter), for the worker's
    dispatch to a transport's own load."""

    name = "handed"
    manifest = "handed.json"

    @classmethod
    def publisher(cls, cfg, fabric, model, tokenizer):
        raise AssertionError("the trainer's side is not under test")

    @classmethod
    def worker_load(cls, worker, model, manifest, reload):
        for name, value in manifest["values"].items():
            model.get_parameter(name).data.fill_(value)
        return set(manifest["values"])


def test_the_worker_loads_through_the_senders_own_hook_and_checks_it_loaded_everything(monkeypatch):
    """``asyncrl_load`` finds the transport again from its import path (the RPC carries a string), runs its
    :meth:`worker_load` in the mode the worker chose, and refuses a load that left a parameter out."""
    model = torch.nn.Linear(2, 2)

    class Worker(WeightReceiver):
        model_runner = type("Runner", (), {"get_model": staticmethod(lambda: model)})

    monkeypatch.setattr(WeightReceiver, "_reload_mode", lambda self, requested: requested)
    report = Worker().asyncrl_load(
        Handed.spec(), {"values": {"weight": 1.0, "bias": 2.0}, "reload": "direct"}
    )
    assert report["reload"] == "direct" and model.weight.eq(1).all() and model.bias.eq(2).all()
    with pytest.raises(RuntimeError, match=r"the handed update left 1 parameters .*\['bias'\]"):
        Worker().asyncrl_load(Handed.spec(), {"values": {"weight": 3.0}})
