"""The CPU inference backend: batched generation with a KV cache on a transformers model.

``HFEngine.generate`` takes a batch of requests (each a prompt and ``n`` choices) and decodes them
together: one prefill per prompt, the KV cache expanded to ``n`` rows, finished rows dropped from the
cache as they stop. Prompts are left-padded to a multiple of ``inference.pad_multiple`` so a row sees
the same key length whichever requests share its batch; together with per-choice generators this makes
a seeded request reproducible under any batching. Weights are swapped in place by ``load_weights``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.config.sections import InferenceConfig, ModelConfig
from asyncrl.inference.sampling import processed_logprobs, row_generator, sample_tokens
from asyncrl.models import eos_token_ids, load_model, load_tokenizer

# A row's numbers must not depend on how many rows share its GEMM. Measured (fp32, 1 thread): AVX-512 MKL
# switches kernels below 16 rows; MKL's COMPATIBLE branch (numerics=reproducible) computes the last
# `rows % 4` rows with a separate tail kernel, and rows < 8 with another. So a decode batch keeps at least
# MIN_ROWS rows and a multiple of ROW_MULTIPLE, padded with "dead" rows.
MIN_ROWS = 16
ROW_MULTIPLE = 4


def padded_rows(live: int) -> int:
    """Rows of a decode batch with ``live`` live rows: at least MIN_ROWS, a multiple of ROW_MULTIPLE."""
    return -(-max(live, MIN_ROWS) // ROW_MULTIPLE) * ROW_MULTIPLE


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


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class _Row:
    request: int
    gen: torch.Generator
    req: GenRequest
    stop_ids: set[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    text_end: int | None = None  # where a stop string cut the text


class EngineLimits:
    """What the server checks a request against before it is queued; shared by :class:`HFEngine` and its
    process handle (:class:`asyncrl.inference.engine_process.EngineProcess`)."""

    max_model_len: int
    vocab_size: int

    def check(self, req: GenRequest) -> str | None:
        """Why ``req`` cannot be served, or ``None``; the server turns a reason into a 400."""
        if not req.prompt_ids:
            return "the prompt is empty"
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}"
        if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
            return (
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        return None

    def alive(self) -> bool:
        """Whether the engine can still generate (an engine in another process may die)."""
        return True


class HFEngine(EngineLimits):
    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, seed: int, device: str | None = None):
        """``device``: where the model runs; ``None`` = CUDA when there is one."""
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(model_cfg)
        self.model = load_model(model_cfg, self.device).eval()
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.config.vocab_size)
        self.model_name = model_cfg.name
        self.version = 0
        self.lock = threading.Lock()  # generation and weight loads never overlap
        self._rng = torch.Generator().manual_seed(seed)  # seeds of unseeded requests

    # -- weights ------------------------------------------------------------------------------------
    def load_weights(self, path: str | Path, version: int) -> None:
        """Load every ``*.safetensors`` of ``path`` into the model in place, all or nothing: every file is
        read and every name and shape checked against the model before any served tensor changes.
        Raises ``ValueError`` naming what does not fit (the server answers it with a 400)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

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
        tied = set(getattr(self.model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
        missing = [k for k in own if k not in state and not (k in tied and self.model.config.tie_word_embeddings)]
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
            self.version = version

    # -- generation ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        with self.lock:
            rows = self._rows(requests)
            self._decode(requests, rows)
        out: list[list[Completion]] = [[] for _ in requests]
        for row in rows:
            out[row.request].append(self._completion(row))
        return out

    def _rows(self, requests: list[GenRequest]) -> list[_Row]:
        rows = []
        for i, req in enumerate(requests):
            seed = req.seed if req.seed is not None else int(torch.randint(0, 2**62, (), generator=self._rng))
            stop_ids = set(self.eos_ids) | set(req.stop_token_ids)
            rows += [_Row(i, row_generator(seed, c), req, stop_ids) for c in range(req.n)]
        return rows

    def _decode(self, requests: list[GenRequest], rows: list[_Row]) -> None:
        from asyncrl.inference.kv_cache import preallocated_cache

        lens = [len(r.prompt_ids) for r in requests]
        mult = math.lcm(self.cfg.pad_multiple, ROW_MULTIPLE)  # prefill GEMMs have (prompts x width) rows
        width = -(-max(lens) // mult) * mult
        ids = torch.full((len(requests), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt_ids)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = preallocated_cache(self.model.config, width + max(r.max_tokens for r in requests))
        # keep >= MIN_ROWS positions so the lm_head GEMM has >= 16 rows even for a single prompt
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=min(width, MIN_ROWS),
        ).logits[:, -1]
        # One prefill per prompt, then each prompt's KV rows are repeated for its n choices. The batch
        # keeps padded_rows(...) rows (see MIN_ROWS): padding rows are "dead": they reuse a live row's
        # cache but draw from their own generator and are never recorded.
        batch = list(range(len(rows)))
        live = [True] * len(batch)
        while len(batch) < padded_rows(len(rows)):
            batch.append(0)
            live.append(False)
        dead_gen = torch.Generator().manual_seed(0)
        index = torch.tensor([rows[b].request for b in batch], device=self.device)
        cache.batch_select_indices(index)
        logits, mask = logits[index], mask[index]
        positions = torch.tensor(lens, device=self.device)[index]
        temps = torch.tensor([rows[b].req.temperature for b in batch], device=self.device)
        top_ps = torch.tensor([rows[b].req.top_p for b in batch], device=self.device)
        for _ in range(max(r.req.max_tokens for r in rows)):
            logp = processed_logprobs(logits, temps, top_ps)
            tokens, lps = sample_tokens(
                logp, temps, [rows[b].gen if ok else dead_gen for b, ok in zip(batch, live, strict=True)]
            )
            alive = [
                k
                for k, b in enumerate(batch)
                if live[k] and self._append(rows[b], int(tokens[k]), float(lps[k]), logp[k])
            ]
            if not alive:
                break
            size = padded_rows(len(alive))
            # Compacting copies the whole KV cache: do it when a quarter of the rows are done, not per row.
            if size <= len(batch) * 3 // 4:
                keep = alive + [k for k in range(len(batch)) if k not in set(alive)][: size - len(alive)]
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                tokens, mask, positions, temps, top_ps = tokens[sel], mask[sel], positions[sel], temps[sel], top_ps[sel]
                batch = [batch[k] for k in keep]
                live = [k in set(alive) for k in keep]
            else:
                live = [k in set(alive) for k in range(len(batch))]
            mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            positions = positions + 1

    def _append(self, row: _Row, token: int, logprob: float, logp: torch.Tensor) -> bool:
        """Record one sampled token; return whether the row goes on."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
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
        return Completion(row.tokens, row.logprobs, text, row.finish or "length", row.tops)
