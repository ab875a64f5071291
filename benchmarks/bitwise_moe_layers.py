"""Where does ``numerics=bitwise`` on a mixture of experts leave vLLM's forward? One GPU, one process.

vLLM (in-process engine, batch-invariant, asyncrl's plugin, eager, Triton attention) samples a few tokens for
each prompt alone (a prefill, then decode steps of one row) with forward hooks on every MoE block; the
trainer's bitwise forward (:func:`asyncrl.models.bitwise.install`) runs the same tokens in one pass with the
same hooks. Per layer: does the block's input agree (everything upstream), does its output agree (prefill
rows and decode rows counted apart), and does :mod:`asyncrl.models.vllm_moe` recomputed on vLLM's own input
with vLLM's own weights give vLLM's output (the block's math) or the trainer's (the inputs or weights)? Also
whether the weights vLLM holds equal the trainer's bf16 ones. The sampled tokens' logprobs
(``--temperature``) are compared too, and the trainer runs every sequence a second time packed into one row
(as it trains), so a block that depends on its row's neighbours shows as packed outputs unequal to the lone
ones. Prints one line per prompt and layer where anything differs, a summary, and writes JSON.

    python benchmarks/bitwise_moe_layers.py --out $OUT/bitwise_moe_layers.json --init model=gpu_small \\
        model.init.architecture=Qwen3MoeForCausalLM model.init.num_experts=8 model.init.num_experts_per_tok=2
        \\ model.init.moe_intermediate_size=256 model.init.norm_topk_prob=true

asyncrl must be installed (or ``benchmarks/device_env.sh`` sourced) for vLLM to load its plugin, and vLLM's
MoE kernels present (``benchmarks/device_moe_kernels.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollouts import MODEL, prompts  # noqa: E402

# numerics=bitwise as asyncrl sets it (vLLM's flag and the marker of asyncrl's plugin), vLLM's engine in this
# process
ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "ASYNCRL_NUMERICS": "bitwise",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}  # LLM.apply_model hands the engine a function


def hook_blocks(layers, store: list) -> list:
    """A forward hook on each layer's MoE block appending ``(layer, input, output)`` (CPU copies) to
    ``store``."""

    def hook(i):
        def record(_module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            store.append((i, x.detach().reshape(-1, x.shape[-1]).cpu(), y.detach().reshape(-1, y.shape[-1]).cpu()))

        return record

    return [layer.mlp.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]


def by_layer(blocks: list, layers: int) -> list[tuple]:
    """``(layer, input, output)`` records of one or more forwards as each layer's ``(inputs, outputs)``,
    their rows in the order the forwards ran (a prefill, then each decode step's one row)."""
    import torch  # lazy: with the rest of the GPU side

    return [
        (
            torch.cat([x for i, x, _ in blocks if i == layer]),
            torch.cat([y for i, _, y in blocks if i == layer]),
        )
        for layer in range(layers)
    ]


def vllm_side(model_dir: str, token_ids: list[list[int]], decode: int, temperature: float):
    """Per prompt: the prompt and its ``decode`` sampled tokens, their logprobs, and each MoE block's
    ``(inputs, outputs)`` over the rows vLLM ran (the prefill's, then one per decode step: the last token is
    never run); and each block's weights."""
    from vllm import LLM, SamplingParams  # lazy: after ENV, which vLLM reads at import

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        attention_backend="TRITON_ATTN",
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        compilation_config={"mode": 0, "custom_ops": ["all"]},
    )

    def install(model):
        model.asyncrl_store = []
        model.asyncrl_hooks = hook_blocks(model.model.layers, model.asyncrl_store)
        return [{n: p.detach().cpu() for n, p in layer.mlp.named_parameters()} for layer in model.model.layers]

    weights = llm.apply_model(install)[0]
    seqs, logprobs, per_prompt = [], [], []
    for p, ids in enumerate(token_ids):
        llm.apply_model(lambda m: m.asyncrl_store.clear())
        params = SamplingParams(max_tokens=decode, temperature=temperature, seed=p, ignore_eos=True, logprobs=0)
        sample = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        seqs.append(list(ids) + list(sample.token_ids))
        logprobs.append([step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids, strict=True)])
        per_prompt.append(by_layer(llm.apply_model(lambda m: list(m.asyncrl_store))[0], len(weights)))
    del llm
    return seqs, logprobs, per_prompt, weights


def trainer_side(model_dir: str, seqs: list[list[int]], prompt_lens: list[int], temperature: float):
    """The trainer's bitwise forward of each sequence alone, then of all of them packed in one row: per
    sequence and pass, each MoE block's ``(inputs, outputs)`` and the sampled tokens' logprobs; and the
    model."""
    import torch  # lazy: after bitwise.enable()
    from transformers import AutoModelForCausalLM

    from asyncrl.models import bitwise

    model = bitwise.install(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda"))
    layers = len(model.model.layers)
    store: list = []
    hook_blocks(model.model.layers, store)

    def forward(ids: list[int], pos: list[int]) -> list[float]:
        store.clear()
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=x, position_ids=torch.tensor([pos], device="cuda"), use_cache=False).logits
            return model.asyncrl_token_logprobs(logits, x, torch.full(x.shape, temperature, device="cuda"))[0].tolist()

    alone = []
    for seq, n in zip(seqs, prompt_lens, strict=True):
        lp = forward(seq, list(range(len(seq))))
        alone.append((by_layer(store, layers), lp[n - 1 :]))
    lp = forward([t for seq in seqs for t in seq], [i for seq in seqs for i in range(len(seq))])
    packed, start = [], 0
    for seq, n in zip(seqs, prompt_lens, strict=True):
        rows = [(x[start : start + len(seq)], y[start : start + len(seq)]) for x, y in by_layer(store, layers)]
        packed.append((rows, lp[start + n - 1 : start + len(seq) - 1]))
        start += len(seq)
    return alone, packed, model


def agree(a: list[float], b: list[float]) -> dict:
    """How many of two lists of logprobs are equal, and the largest difference."""
    return {"equal": sum(x == y for x, y in zip(a, b, strict=True)), "tokens": len(a),
            "max_abs": max(abs(x - y) for x, y in zip(a, b, strict=True))}  # fmt: skip


def named(params: dict, suffix: str):
    """The parameter of a vLLM MoE block named ``suffix``, else the one whose name ends with ``.suffix``."""
    if suffix in params:
        return params[suffix]
    (found,) = [p for n, p in params.items() if n.endswith("." + suffix)]
    return found


def recompute(x, params: dict, top_k: int, renormalize: bool):
    """:mod:`asyncrl.models.vllm_moe` on a block's input ``x`` with vLLM's weights of that block."""
    from asyncrl.models import vllm_kernels, vllm_moe  # lazy: after bitwise.enable()

    x = x.cuda()
    logits = vllm_kernels.linear(x, named(params, "gate.weight").cuda())
    weights, ids = vllm_moe.route(logits, top_k, renormalize)
    w13, w2 = named(params, "w13_weight").cuda(), named(params, "w2_weight").cuda()
    return vllm_moe.experts(x, w13, w2, weights, ids).cpu()


def compare(theirs, ours, weights, model, prompt_lens: list[int]) -> list[dict]:
    """Per prompt and layer: which of input, output, recomputation and weights agree (bit for bit); the
    output's rows counted apart for vLLM's prefill and its decode steps. The trainer's rows past vLLM's (the
    last sampled token, which vLLM never runs) are left out."""
    import torch  # lazy: with the rest of the GPU side

    cfg = model.config
    rows = []
    for p, (v_layers, t_layers) in enumerate(zip(theirs, ours, strict=True)):
        n = prompt_lens[p]
        for i, ((vx, vy), (tx, ty)) in enumerate(zip(v_layers, t_layers, strict=True)):
            tx, ty = tx[: len(vx)], ty[: len(vy)]
            mlp = model.model.layers[i].mlp
            again = recompute(vx, weights[i], cfg.num_experts_per_tok, cfg.norm_topk_prob)
            same = (vy == ty).all(-1)
            rows.append(
                {
                    "prompt": p,
                    "layer": i,
                    "prefill_rows": n,
                    "decode_rows": len(vx) - n,
                    "input_equal": torch.equal(vx, tx),
                    "output_equal": torch.equal(vy, ty),
                    "prefill_rows_equal": int(same[:n].sum()),
                    "decode_rows_equal": int(same[n:].sum()),
                    "output_max_abs": float((vy.float() - ty.float()).abs().max()),
                    "recomputed_equals_vllm": torch.equal(again, vy),
                    "recomputed_equals_trainer": torch.equal(again, ty) if torch.equal(vx, tx) else None,
                    "gate_weight_equal": torch.equal(named(weights[i], "gate.weight"), mlp.gate.weight.detach().cpu()),
                    "w13_equal": torch.equal(named(weights[i], "w13_weight"), mlp.experts.gate_up_proj.detach().cpu()),
                    "w2_equal": torch.equal(named(weights[i], "w2_weight"), mlp.experts.down_proj.detach().cpu()),
                }
            )
    return rows


def packing(alone, packed) -> dict:
    """Whether the trainer's MoE blocks give a sequence's rows the same bits alone and packed with the
    others."""
    pairs = [
        (ya, yp)
        for (la, _), (lp, _) in zip(alone, packed, strict=True)
        for (_, ya), (_, yp) in zip(la, lp, strict=True)
    ]
    return {"rows_equal": sum(int((ya == yp).all(-1).sum()) for ya, yp in pairs),
            "rows": sum(len(ya) for ya, _ in pairs)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", nargs="+", default=MODEL, help="overrides of the MoE model to build (random init)")
    ap.add_argument("--model", default=None, help="an HF MoE model dir instead of --init")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--decode", type=int, default=4, help="tokens vLLM samples per prompt (decode steps + 1)")
    ap.add_argument("--temperature", type=float, default=0.7, help="vLLM's sampling temperature, and the trainer's")
    ap.add_argument("--out", default="benchmarks/results/bitwise_moe_layers.json")
    args = ap.parse_args()
    os.environ.update(ENV)
    from asyncrl.models import bitwise  # lazy: after ENV

    bitwise.enable()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from asyncrl.config.compose import compose_config  # lazy: only to build a model
            from asyncrl.models.hf import build_tiny_model

            model_dir = str(build_tiny_model(compose_config(args.init).model.init, Path(tmp) / "model", seed=0))
        from transformers import AutoConfig, AutoTokenizer  # lazy: after ENV

        # pinned as the sidecar's
        os.environ.update(bitwise.runner_env(AutoConfig.from_pretrained(model_dir)))
        tok = AutoTokenizer.from_pretrained(model_dir)
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts(args.prompts)]
        token_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
        lens = [len(t) for t in token_ids]
        seqs, logprobs, theirs, weights = vllm_side(model_dir, token_ids, args.decode, args.temperature)
        alone, packed, model = trainer_side(model_dir, seqs, lens, args.temperature)
        rows = compare(theirs, [layers for layers, _ in alone], weights, model, lens)
    for r in rows:
        if not (r["input_equal"] and r["output_equal"] and r["recomputed_equals_vllm"]):
            print(json.dumps(r), flush=True)
    first = next((r for r in rows if not r["output_equal"]), None)
    print(
        f"blocks compared: {len(rows)}; outputs equal: {sum(r['output_equal'] for r in rows)}; first "
        f"differing: {json.dumps(first)}"
    )
    flat = [x for lp in logprobs for x in lp]
    summary = {
        "temperature": args.temperature,
        "logprobs_vllm_vs_trainer_alone": agree(flat, [x for _, lp in alone for x in lp]),
        "logprobs_vllm_vs_trainer_packed": agree(flat, [x for _, lp in packed for x in lp]),
        "trainer_moe_outputs_packed_vs_alone": packing(alone, packed),
    }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"init": args.init, "model": args.model, **summary, "blocks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
