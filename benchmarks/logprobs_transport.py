"""What carrying sample logprobs costs vLLM's CPU side per decode step, with and without asyncrl's deferral.

``inference.vllm.defer_logprobs`` (``src/asyncrl/inference/vllm/logprobs.py``) holds a final-only request's
logprobs in the engine core until it finishes. This replays, with vLLM 0.26's own classes and no GPU, the CPU
work of one engine step for a batch of requests decoding one token each:

  engine core   the step's arrays (``LogprobsLists``, as the model runner hands them), one
                ``slice_request`` per request (what ``Scheduler.update_from_output`` does) or, deferred,
                asyncrl's ``Deferral.step`` around it (the step's arrays kept whole, vLLM's slicing skipped),
                the ``EngineCoreOutputs`` message through vLLM's ``MsgpackEncoder``
  frontend      ``MsgpackDecoder`` and each request's ``LogprobsProcessor`` (dict or flat logprobs; no
  tokenizer,
                or ``--tokenizer char``, the GPU benchmarks' character tokenizer, for the token texts);
                deferred, with the plugin's bulk ``_update_sample_logprobs``

in three modes: ``plain`` (no logprobs asked), ``per_step`` (vLLM as it is) and ``deferred``. The logprobs
each request ends with are checked equal between ``per_step`` and ``deferred``. Prints a table and writes
JSON. Needs vLLM importable (the GPU environment, or vLLM's pure-Python modules on a CPU machine); the
figures are this machine's CPU and leave out the GIL the engine core's loop shares with its output thread:
not a GPU run's throughput.

    python benchmarks/logprobs_transport.py --requests 256 --steps 256 --out $OUT/logprobs_transport.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _results import stamped, write_results

MODES = ("plain", "per_step", "deferred")


def replay(mode: str, requests: int, steps: int, flat: bool, seed: int = 0, tokenizer=None) -> dict:
    """One pass of ``steps`` decode steps for ``requests`` requests: seconds spent on each side, and each
    request's logprobs as the frontend holds them at the end."""
    import types

    from vllm.logprobs import create_sample_logprobs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from asyncrl.inference.vllm import frontend as vllm_frontend
    from asyncrl.inference.vllm import logprobs as vllm_logprobs

    rng = np.random.default_rng(seed)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    rids = [f"req-{i}" for i in range(requests)]
    index = {r: i for i, r in enumerate(rids)}
    wants = mode != "plain"
    deferral = vllm_logprobs.Deferral() if mode == "deferred" else None
    if deferral is not None:
        params = SamplingParams(logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        for r in rids:
            deferral.add(r, params)
    frontend: Any = LogprobsProcessor
    if deferral is not None:  # the plugin's frontend half: a request's rows read in bulk
        frontend = type("BulkLogprobsProcessor", (LogprobsProcessor,), {})
        vllm_frontend.install_bulk_logprobs(frontend)
    vocab = 50_000 if tokenizer is None else len(tokenizer)
    procs = {r: frontend(tokenizer, create_sample_logprobs(flat), None, 0.0, 0, None) if wants else None for r in rids}
    engine_s = frontend_s = 0.0
    for step in range(steps):
        # the model runner's tolists(): [requests, 1] ids and logprobs, [requests] ranks
        step_lists = LogprobsLists(
            rng.integers(0, vocab, (requests, 1), dtype=np.int32),
            rng.normal(-2.0, 1.0, (requests, 1)).astype(np.float32),
            rng.integers(1, 100, requests, dtype=np.int32),
        )
        mro = types.SimpleNamespace(req_ids=rids, req_id_to_index=index, logprobs=step_lists if wants else None)
        last = step == steps - 1

        def update(mro=mro, last=last, step_lists=step_lists) -> dict:
            """What vLLM's ``update_from_output`` does for logprobs: a slice per request when the step has
            them."""
            lp = mro.logprobs
            return {
                0: EngineCoreOutputs(
                    outputs=[
                        EngineCoreOutput(
                            r,
                            [int(step_lists.logprob_token_ids[i, 0])],
                            new_logprobs=lp.slice_request(i, 1) if lp is not None else None,
                            finish_reason=FinishReason.LENGTH if last else None,
                        )
                        for i, r in enumerate(rids)
                    ]
                )
            }

        t = time.perf_counter()
        result = deferral.step(mro, update, index.__contains__) if deferral is not None else update()
        bufs = encoder.encode(result[0])
        engine_s += time.perf_counter() - t
        t = time.perf_counter()
        for out in decoder.decode(bufs).outputs:
            if out.new_logprobs is not None:
                procs[out.request_id]._update_sample_logprobs(out.new_logprobs)
        frontend_s += time.perf_counter() - t
    final = {r: [next(iter(pos.values())).logprob for pos in p.logprobs] for r, p in procs.items() if p is not None}
    return {"engine_s": engine_s, "frontend_s": frontend_s, "final": final}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256, help="requests decoding together (one step's batch)")
    ap.add_argument("--steps", type=int, default=256, help="decode steps (tokens per request)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flat", type=int, nargs="+", default=[0, 1], help="flat_logprobs off (0) / on (1)")
    ap.add_argument(
        "--tokenizer",
        choices=["none", "char"],
        default="none",
        help="the frontend's tokenizer: none (no token texts) or the character tokenizer of the GPU benchmarks",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/logprobs_transport.json"))
    args = ap.parse_args()
    tokenizer = None
    if args.tokenizer == "char":
        from asyncrl.models.local_tokenizers import build_char_tokenizer

        tokenizer = build_char_tokenizer("ascii_printable")
    rows = []
    for flat in args.flat:
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        finals: dict[str, dict] = {}
        for rep in range(args.repeats + 1):  # the first round warms up
            for mode in MODES:  # interleaved, so a drift of the machine hits every mode alike
                r = replay(mode, args.requests, args.steps, bool(flat), seed=rep, tokenizer=tokenizer)
                if rep:
                    times[mode].append((r["engine_s"], r["frontend_s"]))
                finals[mode] = r["final"]
        if finals["deferred"] != finals["per_step"]:
            raise AssertionError("deferred logprobs differ from per-step ones")
        for mode in MODES:
            engine = statistics.median(e for e, _ in times[mode]) / args.steps
            frontend = statistics.median(f for _, f in times[mode]) / args.steps
            rows.append({"mode": mode, "flat_logprobs": bool(flat), "engine_ms_per_step": 1e3 * engine,
                         "frontend_ms_per_step": 1e3 * frontend})  # fmt: skip
    plain = {r["flat_logprobs"]: r for r in rows if r["mode"] == "plain"}
    print(f"{'mode':<10}{'flat':>6}{'engine ms/step':>16}{'extra':>8}{'frontend ms/step':>18}{'extra':>8}")
    for r in rows:
        p = plain[r["flat_logprobs"]]
        r["engine_extra_ms_per_step"] = r["engine_ms_per_step"] - p["engine_ms_per_step"]
        r["frontend_extra_ms_per_step"] = r["frontend_ms_per_step"] - p["frontend_ms_per_step"]
        print(
            f"{r['mode']:<10}{int(r['flat_logprobs']):>6}{r['engine_ms_per_step']:>16.3f}{r['engine_extra_ms_per_step']:>+8.3f}{r['frontend_ms_per_step']:>18.3f}{r['frontend_extra_ms_per_step']:>+8.3f}"
        )
    import platform

    import vllm

    from asyncrl.numerics import cpu_info

    cpu = cpu_info()["model"] or platform.processor()
    write_results(
        args.out,
        stamped(
            "logprobs_transport",
            cpu=cpu,
            vllm=vllm.__version__,
            requests=args.requests,
            steps=args.steps,
            repeats=args.repeats,
            tokenizer=args.tokenizer,
            rows=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
