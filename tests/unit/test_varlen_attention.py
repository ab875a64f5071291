"""The `varlen` attention glue, on CPU, with a reference kernel standing in for torch's CUDA varlen_attn."""

import pytest
import torch

from asyncrl.models import attention


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None):
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=False):
        seg = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[a:b].transpose(0, 1),
            v[a:b].transpose(0, 1),
            is_causal=is_causal,
            scale=scale,
        )
        out[a:b] = seg.transpose(0, 1)
    return out


def test_cu_seqlens():
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]])
    cu, longest = attention.cu_seqlens_from_positions(pos)
    assert cu.tolist() == [0, 3, 5, 7, 8, 10] and longest == 3 and cu.dtype == torch.int32


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention, key/value heads expanded
def test_packed_rows_match_unpacked_samples(tmp_path, monkeypatch, kv_heads):
    from transformers import AutoModelForCausalLM

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from helpers.launch import MICRO_MODEL

    micro_model = build_tiny_model(
        compose_config([*MICRO_MODEL, f"model.init.num_key_value_heads={kv_heads}"]).model.init,
        tmp_path / "m",
        seed=0,
    )
    monkeypatch.setattr(attention, "_varlen_fn", lambda: (reference_varlen, {"is_causal", "scale"}))
    attention.register()
    ref = AutoModelForCausalLM.from_pretrained(micro_model, attn_implementation="sdpa").eval()
    model = AutoModelForCausalLM.from_pretrained(micro_model, attn_implementation="varlen").eval()
    samples = [torch.randint(6, 30, (n,)) for n in (5, 9, 3, 7)]
    rows = torch.stack(
        [torch.cat(samples[:2]), torch.cat([samples[2], samples[3], torch.zeros(4, dtype=torch.long)])]
    )
    pos = torch.stack(
        [
            torch.cat([torch.arange(5), torch.arange(9)]),
            torch.cat([torch.arange(3), torch.arange(7), torch.arange(4)]),
        ]
    )
    with torch.no_grad():
        packed = model(input_ids=rows, position_ids=pos, use_cache=False).logits
        singles = [ref(input_ids=s[None]).logits[0] for s in samples]
    torch.testing.assert_close(packed[0, :5], singles[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[0, 5:], singles[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, :3], singles[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1, 3:10], singles[3], atol=1e-5, rtol=0)


def test_needs_position_ids():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="position_ids"):
        attention.varlen_attention(None, q, q, q, None)


def test_boundaries_passed_as_kwargs_are_used_instead_of_per_layer_ones(tmp_path, monkeypatch):
    """packed_logprobs computes the boundaries once (packed_kwargs): the layers must take them, not recompute
    them (inside a compiled layer the per-layer cache would split the graph), with the same result."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.trainer.forward import packed_logprobs
    from helpers.inputs import two_packed_rows
    from helpers.launch import MICRO_MODEL

    micro_model = build_tiny_model(compose_config(MICRO_MODEL).model.init, tmp_path / "m", seed=0)
    monkeypatch.setattr(attention, "_varlen_fn", lambda: (reference_varlen, {"is_causal", "scale"}))
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(micro_model, attn_implementation="varlen").eval()
    mb = two_packed_rows()
    pos = mb["position_ids"]
    with torch.no_grad():
        expected = packed_logprobs(model, mb)

        def per_layer(*args):
            raise AssertionError("a layer recomputed the boundaries")

        monkeypatch.setattr(attention, "_boundaries", per_layer)
        assert attention.packed_kwargs(pos)["max_length_q"] == 9
        torch.testing.assert_close(packed_logprobs(model, mb), expected, atol=0, rtol=0)


@pytest.mark.parametrize("impl,takes", [("varlen", True), ("flash_attention_4", True), ("sdpa", False)])
def test_flash_implementations_get_the_boundaries_once_per_forward(impl, takes):
    """transformers' flash paths (flash-attn 2/3/4) get the packed boundaries as kwargs: without them a
    micro-batch of several rows is not treated as packed (samples attend across boundaries), and one row's
    boundaries are derived again in every layer. sdpa gets none: its block-diagonal mask comes from
    position_ids."""
    import types

    from asyncrl.trainer.forward import packed_logprobs

    seen = {}

    class Recorder(torch.nn.Module):
        config = types.SimpleNamespace(_attn_implementation=impl)

        def forward(self, input_ids, position_ids, use_cache, **kwargs):
            seen.update(kwargs)
            return types.SimpleNamespace(logits=torch.zeros(*input_ids.shape, 40))

    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.arange(12)])
    mb = {"input_ids": torch.randint(0, 40, (2, 12)), "position_ids": pos, "temperatures": torch.ones(2, 12)}
    packed_logprobs(Recorder(), mb)
    if takes:
        assert seen["cu_seq_lens_q"].tolist() == [0, 5, 12, 24] and seen["max_length_q"] == 12
    else:
        assert seen == {}


@pytest.mark.parametrize(
    ("cuda", "major", "fa4", "training", "cp", "want"),
    [
        (False, 0, True, True, 1, "sdpa"),  # the CPU: varlen's kernels are CUDA's
        (True, 9, True, True, 1, "varlen_fa4"),  # Hopper with flash-attn-4: the fastest measured
        (True, 9, False, True, 1, "varlen"),  # flash-attn-4 not in this process's environment
        (True, 8, True, True, 1, "varlen"),  # Ampere: flash-attn-4 is Hopper+
        (True, 9, True, False, 1, "sdpa"),  # the built-in sidecar decodes with a KV cache
        (True, 9, True, True, 2, "sdpa"),  # torch's ring attention replaces SDPA's kernels
    ],
)
def test_auto_resolves_to_the_fastest_kernel_this_process_can_run(
    monkeypatch, cuda, major, fa4, training, cp, want
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(attention, "fa4_installed", lambda: fa4)
    device = "cuda" if cuda else "cpu"
    assert attention.resolve("auto", device, training=training, context_parallel=cp) == want
    assert attention.resolve("varlen", device) == "varlen"  # a named kernel is kept as named


def test_fa4_installed_reads_the_distribution(monkeypatch):
    from importlib import metadata

    def version(name):
        if name == "flash-attn-4":
            raise metadata.PackageNotFoundError(name)
        return "1"

    monkeypatch.setattr(attention.metadata, "version", version)
    assert not attention.fa4_installed()
    monkeypatch.setattr(attention.metadata, "version", lambda name: "4.0.0b36")
    assert attention.fa4_installed()


def test_the_gpu_shapes_default_to_auto_and_the_cpu_models_to_sdpa():
    from asyncrl.config.compose import compose_config

    shapes = {"qwen3_4b_shape": "auto", "qwen3_0.6b_shape": "auto", "gpu_small": "auto", "tiny": "sdpa"}
    for model, want in shapes.items():
        assert compose_config([f"model={model}"]).model.attn_implementation == want


def test_load_model_loads_what_auto_resolves_to_where_the_model_will_run(tmp_path, monkeypatch):
    """The trainer loads on the CPU and moves to its GPU: ``runs_on`` decides, not where it loads."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model, load_model
    from helpers.launch import MICRO_MODEL

    cfg = compose_config([*MICRO_MODEL, "model.attn_implementation=auto"]).model
    cfg.name = str(build_tiny_model(cfg.init, tmp_path / "m", seed=0))
    assert load_model(cfg).config._attn_implementation == "sdpa"
    seen = []
    monkeypatch.setattr(
        attention, "resolve", lambda name, device, *a: seen.append((name, str(device))) or "eager"
    )
    assert load_model(cfg, runs_on="cuda:1").config._attn_implementation == "eager"
    assert seen == [("auto", "cuda:1")]
