"""Does the trainer's ``numerics=bitwise`` forward give vLLM's logprobs bit for bit? One GPU.

1. vLLM (``VLLM_BATCH_INVARIANT=1``, asyncrl's plugin, Triton attention; eager, with CUDA graphs, or
   compiled) samples ``--prompts`` x ``--n`` completions with the sampled token's logprob, at temperature 1
   and 0.7; the same request alone (batch invariance) and the finished samples as one prefill with
   ``prompt_logprobs`` (decode vs prefill inside vLLM) are compared bit for bit.
2. The trainer's side, in a fresh process: the HF model with :func:`asyncrl.models.bitwise.install`, all
   samples packed into rows, scores every completion token; compared bit for bit with vLLM's logprobs, next
   to the plain HF forward (``varlen`` attention, :func:`compute_logprobs`). One backward pass checks the
   gradient against the plain forward's (cosine).
Prints a line per check and writes JSON.

    python benchmarks/bitwise_probe.py --out $OUT/bitwise_probe.json [--model DIR | --init OVERRIDE...]
    [--ops]
        [--variants eager,graphs]

asyncrl must be installed (``pip install -e .``) for vLLM to load its plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollouts import MODEL, prompts  # noqa: E402

SAMPLE = r"""
import json, os, sys
spec = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
kw = dict(model=spec["model"], dtype="bfloat16", seed=0, logprobs_mode="processed_logprobs",
          gpu_memory_utilization=0.4, attention_backend=spec["backend"])
if spec["eager"]:
    kw["enforce_eager"] = True
if spec["max_step_tokens"]:
    kw.update(max_num_batched_tokens=spec["max_step_tokens"], max_num_seqs=spec["max_step_tokens"])
elif spec["graphs"]:  # CUDA graphs of the eager ops (no Inductor): decode batches padded to capture sizes
    kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["all"]}
else:
    kw["compilation_config"] = {"custom_ops": ["all"]}
llm = LLM(**kw)
tok = llm.get_tokenizer()
ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
       for m in spec["prompts"]]
out = {"prompt_ids": ids, "runs": {}}
for temp in spec["temperatures"]:
    reqs, params = [], []
    for i, x in enumerate(ids):
        for j in range(spec["n"]):
            reqs.append({"prompt_token_ids": x})
            params.append(SamplingParams(temperature=temp, max_tokens=spec["max_tokens"], logprobs=0,
                                         seed=1000 * i + j, ignore_eos=True))
    res = llm.generate(reqs, params, use_tqdm=False)
    samples = [{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                "logprobs": [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]} for o in res]
    alone = llm.generate(reqs[:1], params[:1], use_tqdm=False)[0].outputs[0]
    alone_lp = [d[t].logprob for t, d in zip(alone.token_ids, alone.logprobs)]
    same = list(alone.token_ids) == samples[0]["tokens"] and alone_lp == samples[0]["logprobs"]
    run = {"samples": samples, "alone_equal": same}
    if temp == 1.0:
        try:
            full = [{"prompt_token_ids": s["prompt"] + s["tokens"]} for s in samples]
            pres = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            eq = tot = 0
            for s, o in zip(samples, pres):
                p = len(s["prompt"])
                got = [d[t].logprob for t, d in zip(s["tokens"], o.prompt_logprobs[p:])]
                eq += sum(a == b for a, b in zip(got, s["logprobs"])); tot += len(got)
            run["prefill_equal"] = [eq, tot]
        except Exception as e:  # prompt logprobs unsupported in this runner
            run["prefill_equal"] = repr(e)[:300]
    out["runs"][str(temp)] = run
import torch
try:
    rope = llm.apply_model(lambda m: m.model.layers[0].self_attn.rotary_emb.cos_sin_cache.cpu())[0]
    torch.save(rope, spec["dest"] + ".rope")
except Exception as e:
    print("no rope cache:", repr(e)[:300], file=sys.stderr)
json.dump(out, open(spec["dest"], "w"))
"""

TRAIN = r"""
import json, math, os, sys
spec = json.loads(sys.argv[1])
if spec["bitwise"]:
    from asyncrl.models import bitwise, vllm_kernels, vllm_logprobs
    bitwise.enable()
import torch
from transformers import AutoModelForCausalLM
from asyncrl.models.attention import register
from asyncrl.models.logprobs import compute_logprobs
register()
data = json.load(open(spec["samples"]))
dev = "cuda"
def rows(samples, per_row):
    for s in range(0, len(samples), per_row):
        chunk = samples[s:s + per_row]
        ids, pos, where = [], [], []
        for smp in chunk:
            seq = smp["prompt"] + smp["tokens"]
            where.append((len(ids) + len(smp["prompt"]), len(smp["tokens"])))
            ids += seq; pos += list(range(len(seq)))
        yield chunk, torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), where
def score(model, fn, samples, temp, per_row):
    got = []
    for chunk, ids, pos, where in rows(samples, per_row):
        t = torch.full(ids.shape, temp, device=dev)
        with torch.no_grad():
            lp = fn(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, t)[0]
        for (start, n) in where:
            got.append(lp[start - 1:start - 1 + n].tolist())  # logprobs[i-1] scores token i
    return got
def compare(got, samples):
    eq = tot = 0; k3 = 0.0; worst = 0.0; first = 0; where = []
    for g, s in zip(got, samples):
        for i, (a, b) in enumerate(zip(g, s["logprobs"])):
            eq += a == b; tot += 1; worst = max(worst, abs(a - b))
            r = math.exp(a - b); k3 += r - (a - b) - 1
            if a != b:
                first += i == 0; where.append(len(s["prompt"]) + i)
    return {"equal": eq, "tokens": tot, "max_abs": worst, "mismatch_kl": k3 / max(tot, 1),
            "unequal_first_tokens": first, "unequal_positions": sorted(where)[:: max(1, len(where) // 12)]}
out = {}
if spec["bitwise"]:
    model = bitwise.install(AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).to(dev))
    fn, name = model.asyncrl_token_logprobs, "bitwise"  # the sampler of vLLM's model runner for this model
else:
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, attn_implementation="varlen")
    model = model.to(dev)
    fn, name = compute_logprobs, "plain_hf"
for temp, run in data["runs"].items():
    for per_row in spec["per_row"]:
        got = score(model, fn, run["samples"], float(temp), per_row)
        out[f"T{temp}/{name}/rows_of_{per_row}"] = compare(got, run["samples"])
if spec["bitwise"] and os.path.exists(spec["samples"] + ".rope"):
    theirs = torch.load(spec["samples"] + ".rope")
    cfg = model.config
    theta = float(cfg.rope_parameters["rope_theta"])
    ours = vllm_kernels.rope_cache(cfg.head_dim, theta, cfg.max_position_embeddings, dev)
    out["rope_cache_equal"] = [theirs.dtype == ours.dtype, tuple(theirs.shape) == tuple(ours.shape),
                               bool(torch.equal(theirs.to(dev), ours)) if theirs.shape == ours.shape else None]
# a gradient sample for the parent to compare: fp32 masters as the trainer holds them (the plain forward under
# bf16 autocast, the bitwise one rounding each weight to bf16 itself); per parameter its norm and a strided sample
if spec["bitwise"]:
    model = bitwise.install(AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(dev))
else:
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="varlen")
    model = model.to(dev)
chunk, ids, pos, where = next(rows(data["runs"]["1.0"]["samples"][:8], 8))
with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not spec["bitwise"]):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    logits.retain_grad()
    lp = fn(logits, ids, torch.ones(ids.shape, device=dev))
lp.sum().backward()
out["grad_diag"] = {"tied": model.lm_head.weight is model.model.embed_tokens.weight,
                    "logits_grad_norm": float(logits.grad.float().norm()), "vocab": int(logits.shape[-1]),
                    "embed_grad_norm": float(model.model.embed_tokens.weight.grad.norm()),
                    "lm_head_grad_norm": float(model.lm_head.weight.grad.norm())}
torch.save({n: (p.grad.norm().item(), p.grad.flatten()[:: max(1, p.numel() // 65536)].cpu())
            for n, p in model.named_parameters() if p.grad is not None}, spec["dest"] + ".grad")
json.dump(out, open(spec["dest"], "w"))
"""

OPS = r"""
import json, sys
from asyncrl.models import bitwise, vllm_kernels, vllm_logprobs
bitwise.enable()
import torch
v = vllm_kernels._vllm()
dev = "cuda"; g = torch.Generator(device=dev).manual_seed(0)
def rnd(*shape): return torch.randn(*shape, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
out = {}
def rows_invariant(name, fn, x, ms=(1, 7, 64, 100, 255, 256, 800)):
    full = fn(x)
    full = full if isinstance(full, tuple) else (full,)
    res = {}
    for m in ms:
        part = fn(x[:m]); part = part if isinstance(part, tuple) else (part,)
        res[m] = all(torch.equal(a, b[:m]) for a, b in zip(part, full))
    out[name] = res
x = rnd(2048, 1024); w = rnd(3072, 1024) * 0.03; nw = rnd(1024) * 0.1 + 1; r = rnd(2048, 1024)
rows_invariant("matmul_persistent", lambda a: v.matmul(a, w.t()), x)
rows_invariant("rms_norm_triton", lambda a: v.rms_norm(a, nw, 1e-6), x)
def fused(a):
    a2, r2 = a.clone(), r[: len(a)].clone(); v.fused_add_rms_norm(a2, r2, nw, 1e-6); return a2, r2
rows_invariant("fused_add_rms_norm", fused, x)
def ours(a):
    a2, r2 = a.clone(), r[: len(a)].clone(); vllm_kernels.fused_add_rms_norm(a2, r2, nw, 1e-6); return a2, r2
rows_invariant("asyncrl_fused_add_rms_norm", ours, x)
def silu(a):
    o = torch.empty(len(a), 512, device=dev, dtype=a.dtype); v.silu_and_mul(o, a); return o
rows_invariant("silu_and_mul", silu, x)
cache = vllm_kernels.rope_cache(128, 1e6, 40960, dev); pos = torch.arange(2048, device=dev) % 300
def rot(a):
    q, k = a[:, :1024].clone(), a[:, :512].clone().contiguous()
    v.rotary_embedding(pos[: len(a)], q, k, 128, cache, True); return q, k
rows_invariant("rotary", rot, x)
logits = rnd(2048, 151936) * 3; tgt = torch.randint(0, 151936, (2048, 1), device=dev, generator=g)
rows_invariant("compute_token_logprobs", lambda a: v.compute_token_logprobs(a, tgt[: len(a)]), logits, ms=(1, 64, 300))
# attention: each sequence's rows computed as one prefill, against each row computed alone as a decode step
lens = [37, 100, 16, 130]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
T = int(cu[-1]); q, k, vv = rnd(T, 16, 128), rnd(T, 8, 128), rnd(T, 8, 128)
att = vllm_kernels.PackedAttention(cu, max(lens))
full = att(q, k, vv, 128 ** -0.5)
eq = tot = 0
for i, n in enumerate(lens):
    for t in (0, n // 2, n - 1):
        row = int(cu[i]) + t
        one = vllm_kernels.PackedAttention(torch.tensor([0, t + 1], device=dev, dtype=torch.int32), t + 1)
        # a decode step: the query is only the last token; keys are the sequence up to it
        kc, vc = one.paged(k[int(cu[i]):row + 1]), one.paged(vv[int(cu[i]):row + 1])
        o = torch.empty(1, 16, 128, device=dev, dtype=torch.bfloat16)
        ones = torch.ones(1, dtype=torch.float32, device=dev).expand(1, 8)
        v.unified_attention(q=q[row:row + 1].contiguous(), k=kc, v=vc, out=o,
            cu_seqlens_q=torch.tensor([0, 1], device=dev, dtype=torch.int32), max_seqlen_q=1,
            seqused_k=torch.tensor([t + 1], device=dev, dtype=torch.int32), max_seqlen_k=t + 1,
            softmax_scale=128 ** -0.5, causal=True, window_size=(-1, -1), block_table=one.block_table, softcap=0,
            q_descale=None, k_descale=ones, v_descale=ones)
        eq += torch.equal(o.flatten(), full[row]); tot += 1
out["attention_decode_vs_prefill"] = [eq, tot]
alone = vllm_kernels.PackedAttention(cu[:2], lens[0])(q[:lens[0]], k[:lens[0]], vv[:lens[0]], 128 ** -0.5)
out["attention_alone_vs_packed"] = torch.equal(alone, full[:lens[0]])
# a MoE layer (Qwen3-30B-A3B's routing: 32 experts of 768, top 8): vLLM's router and fused experts, each row alone
try:
    from asyncrl.models import vllm_moe
    w13, w2, wg = rnd(32, 1536, 1024) * 0.03, rnd(32, 1024, 768) * 0.03, rnd(32, 1024) * 0.03
    def moe(a):
        weights, ids = vllm_moe.route(vllm_kernels.linear(a, wg), 8, True)
        return vllm_moe.experts(a, w13, w2, weights, ids), weights, ids
    rows_invariant("moe_router_and_experts", moe, x)
    one = torch.cat([moe(x[i:i + 1])[0] for i in range(0, 64)])
    out["moe_decode_rows_vs_prefill"] = torch.equal(one, moe(x[:64])[0])
except Exception as e:  # no MoE kernels carried (benchmarks/device_moe_kernels.sh)
    out["moe_router_and_experts"] = f"{type(e).__name__}: {e}"[:300]
# each wrapper's backward against autograd through its reference expression, on the same inputs
def grad_check(name, fn, ref, *inputs):
    res = []
    for f in (fn, ref):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        o = f(*xs); o = o if isinstance(o, tuple) else (o,)
        torch.manual_seed(1)
        sum((oo.float() * torch.randn_like(oo.float())).sum() for oo in o).backward()
        res.append(torch.cat([x.grad.float().flatten() for x in xs if x.grad is not None]))
    a, b = res
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    out["grad/" + name] = [round(cos, 4), round(float(a.norm() / b.norm()), 4)]
xs, ws = rnd(300, 1024), rnd(2048, 1024) * 0.03
grad_check("linear", vllm_kernels.linear, lambda a, b: a @ b.t(), xs, ws)
grad_check("rms_norm", lambda a, b: vllm_kernels.rms_norm(a, b, 1e-6),
           lambda a, b: vllm_kernels.rms_reference(a, b, 1e-6), xs, nw)
grad_check("add_rms_norm", lambda a, r_, b: vllm_kernels.add_rms_norm(a, r_, b, 1e-6),
           lambda a, r_, b: (vllm_kernels.rms_reference(a + r_, b, 1e-6), a + r_), xs, r[:300], nw)
grad_check("silu_and_mul", vllm_kernels.silu_and_mul, lambda a: torch.nn.functional.silu(a[:, :512]) * a[:, 512:], xs)
def rot_ref(p_, a, b):
    return vllm_kernels.rope_reference(p_, a, cache, 128), vllm_kernels.rope_reference(p_, b, cache, 128)
grad_check("rotary", lambda p_, a, b: vllm_kernels.rotary(p_, a, b, cache, 128), rot_ref,
           pos[:300], xs, xs[:, :512].contiguous())
from asyncrl.models.attention import packed_attention
grad_check("attention", lambda a, b, c: att(a, b, c, 128 ** -0.5),
           lambda a, b, c: packed_attention(a, b, c, cu, max(lens), 128 ** -0.5).flatten(1), q, k, vv)
lg = rnd(300, 1000) * 3; tg = torch.randint(0, 1000, (300,), device=dev, generator=g)
grad_check("token_logprobs", lambda a: vllm_logprobs._TokenLogprobs.apply(a, tg, torch.ones(300, device=dev)),
           lambda a: torch.log_softmax(a.float(), -1).gather(-1, tg[:, None]).squeeze(1), lg)
json.dump(out, open(sys.argv[1], "w"))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="an HF model dir (default: --init's model, random init)")
    ap.add_argument(
        "--init",
        nargs="+",
        default=MODEL,
        help="overrides of the model to build (default: the Qwen3-0.6B shape)",
    )
    ap.add_argument(
        "--variants",
        default="eager,graphs",
        help="eager, graphs (CUDA graphs, no Inductor), compiled, eager255",
    )
    ap.add_argument("--ops", action="store_true", help="first, each kernel's row invariance (M, decode vs prefill)")
    ap.add_argument("--out", default="benchmarks/results/bitwise_probe.json")
    args = ap.parse_args()
    # numerics=bitwise as asyncrl sets it: vLLM's flag, and the marker under which asyncrl's vLLM plugin (an
    # installed entry point) puts its batch-invariant residual RMSNorm in vLLM's engine
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1", ASYNCRL_NUMERICS="bitwise")
    result: dict = {}
    if args.ops:
        dest = Path(tempfile.mkdtemp()) / "ops.json"
        p = subprocess.run([sys.executable, "-c", OPS, str(dest)], env=env, capture_output=True, text=True)
        result["ops"] = json.loads(dest.read_text()) if p.returncode == 0 else {"error": p.stderr[-4000:]}
        print(f"ops: {result['ops']}", flush=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").exists() else None) as tmp:
        model = args.model
        if model is None:
            from asyncrl.config.compose import compose_config
            from asyncrl.models.hf import build_tiny_model

            model = str(build_tiny_model(compose_config(args.init).model.init, Path(tmp) / "model", seed=0))
        from transformers import AutoConfig

        from asyncrl.models.bitwise import runner_env

        # vLLM's model runner, pinned as the sidecar's
        env.update(runner_env(AutoConfig.from_pretrained(model)))
        for variant in args.variants.split(","):
            dest = Path(tmp) / f"{variant}.json"
            spec = {
                "model": model,
                "prompts": prompts(args.prompts),
                "n": args.n,
                "max_tokens": args.max_tokens,
                "temperatures": [1.0, 0.7],
                "backend": "TRITON_ATTN",
                "eager": variant.startswith("eager"),
                "graphs": variant == "graphs",
                "max_step_tokens": 255 if variant.endswith("255") else None,
                "dest": str(dest),
            }
            p = subprocess.run(
                [sys.executable, "-c", SAMPLE, json.dumps(spec)], env=env, capture_output=True, text=True
            )
            if p.returncode:
                print(f"{variant}: vLLM failed\n{p.stderr[-3000:]}", flush=True)
                result[variant] = {"error": p.stderr[-3000:]}
                continue
            data = json.loads(dest.read_text())
            checks = {t: {k: v for k, v in r.items() if k != "samples"} for t, r in data["runs"].items()}
            print(f"{variant}: vLLM batch-invariance/prefill checks {checks}", flush=True)
            train: dict = {}
            for bw in (True, False):
                tdest = Path(tmp) / f"{variant}_{bw}.json"
                tspec = {"model": model, "samples": str(dest), "per_row": [8], "dest": str(tdest),
                         "bitwise": bw}  # fmt: skip
                p = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(tspec)], env=env if bw else None,
                                   capture_output=True, text=True)  # fmt: skip
                if p.returncode:
                    print(f"{variant}: trainer (bitwise={bw}) failed\n{p.stderr[-4000:]}", flush=True)
                    train[f"error_{bw}"] = p.stderr[-4000:]
                    continue
                got = json.loads(tdest.read_text())
                if "grad_diag" in got:
                    got[f"grad_diag_{'bitwise' if bw else 'plain'}"] = got.pop("grad_diag")
                train.update(got)
            if "error_True" not in train and "error_False" not in train:
                import torch

                a = torch.load(Path(tmp) / f"{variant}_True.json.grad")
                b = torch.load(Path(tmp) / f"{variant}_False.json.grad")
                per = sorted(
                    (
                        float(torch.nn.functional.cosine_similarity(a[n][1], b[n][1], dim=0)),
                        a[n][0] / b[n][0],
                        n,
                    )
                    for n in a
                )
                train["grad_vs_plain"] = {
                    "params": len(per),
                    "median_cosine": per[len(per) // 2][0],
                    "worst": [(round(c, 4), round(r, 3), n) for c, r, n in per[:4]],
                }
            for k, v in train.items():
                print(f"{variant}: {k}: {str(v)[:400]}", flush=True)
            result[variant] = {"vllm": checks, "trainer": train}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
