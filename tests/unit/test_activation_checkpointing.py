"""Which decoder layers `trainer.fabric.activation_checkpointing_every` recomputes and what they keep
(`activation_checkpointing_saves`), on both paths (transformers' per-layer switch for one device; torch's
checkpoint_wrapper, which FSDP2 shards, otherwise), and that recomputing changes no gradient."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.trainer.parallel import (
    ATTENTION,
    SAVES,
    apply_activation_checkpointing,
    checkpoint_context,
    decoder_layers,
)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory):
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from helpers.launch import MICRO_MODEL

    init = compose_config([*MICRO_MODEL, "model.init.num_hidden_layers=4"]).model.init
    return build_tiny_model(init, tmp_path_factory.mktemp("m") / "model", seed=0)


def forwards_and_grads(model) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Forward and backward on a fixed batch: how many times each decoder layer ran forward (twice when
    backward recomputes it), and every parameter's gradient by its name."""
    calls = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "_checkpoint_wrapped_module", layer).self_attn
        attn.q_proj.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.train()
    ids = torch.randint(6, 30, (2, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return calls, grads


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "fsdp2_wrapper"])
@pytest.mark.parametrize("every,recomputed", [(1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3])])
def test_every_kth_layer_is_recomputed_and_the_gradients_stay(micro_model_dir, sharded, every, recomputed):
    from transformers import AutoModelForCausalLM

    plain_calls, plain_grads = forwards_and_grads(AutoModelForCausalLM.from_pretrained(micro_model_dir))
    assert plain_calls == [1, 1, 1, 1]
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    apply_activation_checkpointing(model, sharded=sharded, every=every)
    calls, grads = forwards_and_grads(model)
    assert calls == [2 if i in recomputed else 1 for i in range(4)]
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


class OpCount(TorchDispatchMode):
    """The ops that run while it is active, by name (``aten::mm``), counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name().split(".", 1)[0]] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(model) -> tuple[Counter[str], Counter[str], dict[str, torch.Tensor]]:
    """The ops of the forward, the ops the backward runs (a recomputed forward's among them) and the
    gradients."""
    model.train()
    ids = torch.randint(6, 30, (2, 24), generator=torch.Generator().manual_seed(0))
    with OpCount() as fwd:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the trainer calls it
    with OpCount() as bwd:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return fwd.counts, bwd.counts, grads


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "fsdp2_wrapper"])
def test_selective_checkpointing_recomputes_only_what_it_does_not_keep(micro_model_dir, sharded):
    from transformers import AutoModelForCausalLM

    fwd, plain, plain_grads = backward_ops(AutoModelForCausalLM.from_pretrained(micro_model_dir))
    attention = [name for name in fwd if name in ATTENTION]
    assert attention, f"no attention op of {sorted(ATTENTION)} ran in the forward: {sorted(fwd)}"
    recomputed = {}
    for saves in SAVES:
        model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
        apply_activation_checkpointing(model, sharded=sharded, every=2, saves=saves)
        _, counts, grads = backward_ops(model)
        assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads), saves
        recomputed[saves] = {op: counts[op] - plain[op] for op in ("aten::mm", *attention)}
    per_layer = (fwd["aten::mm"] - 1) // 4  # the forward's matmuls but lm_head's, over four layers
    # layers 0 and 2 run again up to their last matmul, whose output backward does not need (torch stops
    # there)
    assert recomputed["nothing"] == {"aten::mm": 2 * (per_layer - 1), **{op: 2 for op in attention}}
    assert recomputed["matmuls"] == {"aten::mm": 0, **{op: 2 for op in attention}}
    assert recomputed["matmuls_and_attention"] == {"aten::mm": 0, **{op: 0 for op in attention}}


def test_an_unknown_choice_is_refused_by_name():
    with pytest.raises(ValueError, match="allowed: \\['matmuls', 'matmuls_and_attention', 'nothing'\\]"):
        checkpoint_context("everything")
