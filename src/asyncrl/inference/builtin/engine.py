"""The CPU inference backend: continuous batching with a KV cache on a transformers model.

The engine is driven one decode step at a time (:meth:`HFEngine.add`, :meth:`HFEngine.step`): requests join
between decode steps and leave as soon as their last row stops, so a long completion never holds back new
requests, and ``load_weights`` between two steps lands in the middle of running completions (each token
records the policy version whose forward produced it; the KV cache of earlier tokens stays as the old
weights computed it, as in vLLM and PipelineRL). ``generate`` is add + step until done, for direct use.

Requests are decoded in *cohorts*: requests of one padded prompt width (``inference.pad_multiple``),
prefilled together, each prompt's KV rows repeated for its ``n`` choices, finished rows dropped as they
stop. Each decode step advances every cohort by one token. Rows of different cohorts never share a
GEMM: a row's numbers depend on the key length and row count of its batch (see MIN_ROWS), and keeping
those fixed per cohort is what makes a seeded request reproduce bit for bit whatever else is running.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine_limits import EngineLimits
from asyncrl.inference.builtin.expert_routes import (
    add_prompt_routes,
    add_step_routes,
    recording,
    routes_array,
)
from asyncrl.inference.builtin.kv_cache import preallocated_cache
from asyncrl.inference.builtin.padding import MIN_ROWS, padded_rows, prompt_width
from asyncrl.inference.builtin.sampling import processed_logprobs, row_generator, sample_tokens
from asyncrl.models.adapters import AdapterMerger, is_adapter_dir
from asyncrl.models.hf import eos_token_ids, load_model, load_tokenizer
from asyncrl.models.logprobs import compute_logprobs
from asyncrl.models.moe import Routing, fuse_experts, routers


@dataclass
class GenRequest:
    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    routed_experts: bool = False  # record the experts each token is routed to (a mixture of experts)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that produced each token
    # int16 [prompt + completion - 1, MoE layers, top_k] (builtin/expert_routes.py)
    routed_experts: Any = None


@dataclass
class _Row:
    request: int
    gen: torch.Generator
    req: GenRequest
    stop_ids: set[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    text_end: int | None = None  # where a stop string cut the text
    routes: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Job:
    requests: list[GenRequest]
    rows: list[_Row]
    open_cohorts: int = 0


class _Cohort:
    """Rows of requests with one padded prompt width, decoded together until every row has stopped.

    ``logits`` holds the next token's distribution of each batch row and ``version`` the policy that
    computed it; a step samples from it, records the tokens, drops finished rows now and then, and runs
    the forward of the next position with whatever weights the engine holds at that moment.
    """

    def __init__(
        self, engine: HFEngine, job: int, members: list[int], all_requests: list[GenRequest], rows, width
    ):
        """``members``: indices in ``all_requests`` (the job's) of this cohort's requests; ``rows``:
        theirs."""
        self.engine, self.job, self.rows = engine, job, rows
        device = engine.device
        requests = [all_requests[i] for i in members]
        local = {g: i for i, g in enumerate(members)}
        lens = [len(r.prompt_ids) for r in requests]
        ids = torch.full((len(requests), width), engine.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt_ids)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        self.cache = preallocated_cache(engine.model.config, width + max(r.max_tokens for r in requests))
        # keep >= MIN_ROWS positions so the lm_head GEMM has >= 16 rows even for a single prompt
        with recording(engine.routing, rows) as picks:
            logits = engine.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=min(width, MIN_ROWS),
            ).logits[:, -1]
        add_prompt_routes(picks, rows, [local[r.request] for r in rows], width)
        self.version = engine.version
        # One prefill per prompt, then each prompt's KV rows are repeated for its n choices. The batch keeps
        # padded_rows(...) rows (see MIN_ROWS): padding rows are "dead": they reuse a live row's cache but
        # draw from their own generator and are never recorded.
        self.batch = list(range(len(rows)))
        self.live = [True] * len(self.batch)
        while len(self.batch) < padded_rows(len(rows)):
            self.batch.append(0)
            self.live.append(False)
        self.dead_gen = torch.Generator().manual_seed(0)
        index = torch.tensor([local[rows[b].request] for b in self.batch], device=device)
        self.cache.batch_select_indices(index)
        self.logits, self.mask = logits[index], mask[index]
        self.positions = torch.tensor(lens, device=device)[index]
        self.temps = torch.tensor([rows[b].req.temperature for b in self.batch], device=device)
        self.top_ps = torch.tensor([rows[b].req.top_p for b in self.batch], device=device)
        self.top_ks = torch.tensor([rows[b].req.top_k for b in self.batch], device=device)
        self.min_ps = torch.tensor([rows[b].req.min_p for b in self.batch], device=device)

    def step(self) -> bool:
        """Sample one token for every live row and compute the next logits; ``False`` once every row
        stopped."""
        rows, batch, live = self.rows, self.batch, self.live
        logp = processed_logprobs(self.logits, self.temps, self.top_ps, self.top_ks, self.min_ps)
        tokens, lps = sample_tokens(
            logp,
            self.temps,
            [rows[b].gen if ok else self.dead_gen for b, ok in zip(batch, live, strict=True)],
        )
        alive = [
            k
            for k, b in enumerate(batch)
            if live[k] and self.engine._append(rows[b], int(tokens[k]), float(lps[k]), logp[k], self.version)
        ]
        if not alive:
            return False
        size = padded_rows(len(alive))
        keep_alive = set(alive)
        # Compacting copies the whole KV cache: do it when a quarter of the rows are done, not per row.
        if size <= len(batch) * 3 // 4:
            keep = alive + [k for k in range(len(batch)) if k not in keep_alive][: size - len(alive)]
            sel = torch.tensor(keep, device=self.engine.device)
            self.cache.batch_select_indices(sel)
            tokens, self.mask, self.positions = tokens[sel], self.mask[sel], self.positions[sel]
            self.temps, self.top_ps = self.temps[sel], self.top_ps[sel]
            self.top_ks, self.min_ps = self.top_ks[sel], self.min_ps[sel]
            self.batch = [batch[k] for k in keep]
            self.live = [k in keep_alive for k in keep]
        else:
            self.live = [k in keep_alive for k in range(len(batch))]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.batch), 1))], dim=1)
        with recording(self.engine.routing, rows) as picks:
            self.logits = self.engine.model(
                input_ids=tokens[:, None],
                attention_mask=self.mask,
                position_ids=self.positions[:, None],
                past_key_values=self.cache,
                use_cache=True,
            ).logits[:, -1]
        add_step_routes(picks, rows, self.batch, self.live)
        self.version = self.engine.version
        self.positions = self.positions + 1
        return True


class HFEngine(EngineLimits):
    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, seed: int, device: str | None = None):
        """``device``: where the model runs; ``None`` = CUDA when there is one."""
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(model_cfg)
        self.model = load_model(model_cfg, self.device, training=False).eval()
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.config.vocab_size)
        self.model_name = model_cfg.name
        self.version = 0
        self.lock = threading.Lock()  # steps and weight loads never overlap
        self._rng = torch.Generator().manual_seed(seed)  # seeds of unseeded requests
        self.jobs: dict[int, _Job] = {}
        self.cohorts: list[_Cohort] = []
        self._next_job = 0
        self.stats = {"cohorts": 0, "steps": 0}
        self.lora = AdapterMerger()  # LoRA hand-offs are merged into the base weights on load
        self.routing = Routing(self.model) if routers(self.model) else None  # a mixture of experts' routes

    # -- weights ------------------------------------------------------------------------------------
    def load_weights(self, path: str | Path, version: int) -> None:
        """Load every ``*.safetensors`` of ``path`` into the model in place, all or nothing: every file is
        read and every name and shape checked against the model before any served tensor changes.
        Raises ``ValueError`` naming what does not fit (the server answers it with a 400). Called between
        decode steps, the next token of every running row comes from the new weights.

        A LoRA adapter (peft layout, ``model.lora``) is merged into the base weights instead (see
        :class:`~asyncrl.models.adapters.AdapterMerger`)."""
        if is_adapter_dir(path):
            merged = self.lora.merged_state(self.model, Path(path))
            with self.lock:
                self.model.load_state_dict(merged, strict=False)
                self.version = version
            return

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        state = {}
        for f in files:
            try:
                state.update(load_file(f, device=str(self.device)))
            except SafetensorError as e:  # truncated or not safetensors at all
                raise ValueError(f"{f.name} is not a readable safetensors file ({e})") from None
        own = self.model.state_dict()
        state = fuse_experts(state, own)  # a mixture of experts' hand-off holds one tensor per expert
        tied = set(getattr(self.model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
        missing = [
            k for k in own if k not in state and not (k in tied and self.model.config.tie_word_embeddings)
        ]
        unexpected = [k for k in state if k not in own]
        shapes = [
            f"{k} {tuple(v.shape)} (model: {tuple(own[k].shape)})"
            for k, v in state.items()
            if k in own and v.shape != own[k].shape
        ]
        if missing or unexpected or shapes:
            raise ValueError(
                f"weights in {path} do not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, wrong shapes {shapes[:5]}"
            )
        with self.lock:
            self.model.load_state_dict(state, strict=False)
            self.lora.forget()
            self.version = version

    # -- generation ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.cohorts)

    @torch.inference_mode()
    def add(self, requests: list[GenRequest], job_id: int | None = None) -> int:
        """Start decoding ``requests`` (prefill now, tokens from the next :meth:`step`); returns the job id
        (``job_id`` if given: the caller's own key) that :meth:`step` reports when the last of them is
        done."""
        with self.lock:
            if job_id is None:
                job_id, self._next_job = self._next_job, self._next_job + 1
            if job_id in self.jobs:
                raise ValueError(f"job {job_id} is already running")
            rows = self._rows(requests)
            job = self.jobs[job_id] = _Job(requests, rows)
            widths: dict[int, list[int]] = {}
            for i, r in enumerate(requests):
                widths.setdefault(prompt_width(len(r.prompt_ids), self.cfg.pad_multiple), []).append(i)
            try:
                for width, members in sorted(widths.items()):
                    picked = set(members)
                    cohort = _Cohort(
                        self, job_id, members, requests, [r for r in rows if r.request in picked], width
                    )
                    self.cohorts.append(cohort)
                    job.open_cohorts += 1
                    self.stats["cohorts"] += 1
            except BaseException:
                self.cancel(job_id)
                raise
            return job_id

    def cancel(self, job_id: int) -> None:
        """Forget a job and stop decoding its rows."""
        self.cohorts = [c for c in self.cohorts if c.job != job_id]
        self.jobs.pop(job_id, None)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, list[list[Completion]]]]:
        """One decode step of every running cohort; the jobs that finished, with their completions (per
        request, per choice)."""
        finished = []
        with self.lock:
            self.stats["steps"] += 1
            for cohort in list(self.cohorts):
                if cohort.step():
                    continue
                self.cohorts.remove(cohort)
                job = self.jobs[cohort.job]
                job.open_cohorts -= 1
                if job.open_cohorts == 0:
                    del self.jobs[cohort.job]
                    out: list[list[Completion]] = [[] for _ in job.requests]
                    for row in job.rows:
                        out[row.request].append(self._completion(row))
                    finished.append((cohort.job, out))
        return finished

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's token logprobs under the current weights at temperature 1: for token ``i >= 1`` its
        logprob given tokens ``< i`` (vLLM's ``prompt_logprobs``; a teacher's answer in online distillation).
        One forward per prompt, between decode steps (``EngineClient.call``)."""
        out = []
        with self.lock:
            for ids in prompts:
                x = torch.tensor([ids], device=self.device)
                logits = self.model(input_ids=x, use_cache=False).logits
                # the trainer's own function, so a teacher's answer and the trainer's logprobs agree by
                # construction
                lp = compute_logprobs(logits, x, torch.ones(x.shape, device=self.device))
                out.append(lp[0].tolist())
        return out

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Decode ``requests`` to the end (an engine used directly, with nothing else running)."""
        if self.jobs:
            raise RuntimeError("generate() on an engine with running jobs: use add() and step()")
        job = self.add(requests)
        while True:
            for done, out in self.step():
                if done == job:
                    return out

    def _rows(self, requests: list[GenRequest]) -> list[_Row]:
        rows = []
        for i, req in enumerate(requests):
            seed = (
                req.seed if req.seed is not None else int(torch.randint(0, 2**62, (), generator=self._rng))
            )
            stop_ids = set(self.eos_ids) | set(req.stop_token_ids)
            rows += [_Row(i, row_generator(seed, c), req, stop_ids) for c in range(req.n)]
        return rows

    def _append(self, row: _Row, token: int, logprob: float, logp: torch.Tensor, version: int) -> bool:
        """Record one sampled token; return whether the row goes on."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(version)
        if row.req.top_logprobs:
            vals, idx = logp.topk(row.req.top_logprobs)
            row.tops.append(list(zip(idx.tolist(), vals.tolist(), strict=True)))
        if token in row.stop_ids:
            row.finish = "stop"
        elif row.req.stop:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            hits = [text.find(s) for s in row.req.stop if s and s in text]
            if hits:
                row.finish, row.text_end = "stop", min(hits)
        if row.finish is None and len(row.tokens) >= row.req.max_tokens:
            row.finish = "length"
        return row.finish is None

    def _completion(self, row: _Row) -> Completion:
        body = row.tokens[:-1] if row.tokens and row.tokens[-1] in row.stop_ids else row.tokens
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        if row.text_end is not None:
            text = text[: row.text_end]
        return Completion(
            row.tokens, row.logprobs, text, row.finish or "length", row.tops, row.versions, routes_array(row)
        )
