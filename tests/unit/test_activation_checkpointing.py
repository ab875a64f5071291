"""Which decoder layers `trainer.fabric.activation_checkpointing_every` recomputes, on both paths (transformers'
per-layer switch for one device; torch's checkpoint_wrapper, which FSDP2 shards, otherwise), and that recomputing
changes no gradient."""

import pytest
import torch

from asyncrl.trainer.parallel import apply_activation_checkpointing, decoder_layers


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory):
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from helpers.launch import MICRO_MODEL

    init = compose_config([*MICRO_MODEL, "model.init.num_hidden_layers=4"]).model.init
    return build_tiny_model(init, tmp_path_factory.mktemp("m") / "model", seed=0)


def forwards_and_grads(model) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Forward and backward on a fixed batch: how many times each decoder layer ran forward (twice when backward
    recomputes it), and every parameter's gradient by its name."""
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
