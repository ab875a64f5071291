"""How many characters a token holds, per tokenizer, on English prose, math and code; and which ids survive
decode then encode. Lengths in tokens (packing, prefill, samples' seq_len) follow from these.

    python benchmarks/tokenizer_lengths.py --out benchmarks/results/tokenizer_lengths_cpu.json

Tokenizers: ``qwen3`` (``model.init.tokenizer=qwen3``, :mod:`asyncrl.models.qwen_tokenizer`; run
``python -m asyncrl.models.qwen_tokenizer`` first) and ``byte_bpe`` (shape-only, 151,936 ids). Text that
ships with Python and the project's dependencies, no download: prose from Python's own documentation
(``pydoc_data.topics``), math from reasoning-gym's generators (questions and worked answers), code from the
standard library's sources.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

from _results import report

CHARS = 200_000  # per corpus


def prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:CHARS]


def math() -> str:
    import reasoning_gym as rg

    parts = []
    for task in (
        "basic_arithmetic",
        "simple_equations",
        "gsm_symbolic",
        "fraction_simplification",
        "chain_sum",
    ):
        for item in rg.create_dataset(task, size=200, seed=0):
            parts.append(f"{item['question']}\nAnswer: {item['answer']}")
    return "\n\n".join(parts)[:CHARS]


def code() -> str:
    import asyncio
    import collections
    import email
    import json as json_module

    files = [Path(inspect.getfile(m)) for m in (asyncio, collections, email, json_module)]
    sources = [p.read_text() for f in files for p in sorted(f.parent.glob("*.py"))]
    return "\n\n".join(sources)[:CHARS]


def tokenizer(name: str):
    if name == "qwen3":
        from asyncrl.models.qwen_tokenizer import load_qwen3_tokenizer

        return load_qwen3_tokenizer()
    from asyncrl.models.local_tokenizers import build_byte_bpe_tokenizer

    return build_byte_bpe_tokenizer(151_936)


def id_round_trips(tok) -> tuple[int, int, int]:
    """(ids whose own text encodes back to exactly that id, of those that do not the ones that hold part of a
    character's UTF-8 bytes, all ids); added tokens included."""
    ids = range(len(tok))
    texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    back = tok(texts, add_special_tokens=False)["input_ids"]
    other = [t for i, t, b in zip(ids, texts, back, strict=True) if b != [i]]
    return len(texts) - len(other), sum("\ufffd" in t for t in other), len(texts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", nargs="+", default=["qwen3", "byte_bpe"])
    ap.add_argument("--out", default="benchmarks/results/tokenizer_lengths_cpu.json")
    args = ap.parse_args()
    corpora = {"prose": prose(), "math": math(), "code": code()}
    rows = []
    for name in args.tokenizers:
        tok = tokenizer(name)
        row: dict = {"tokenizer": name, "ids": len(tok)}
        for corpus, text in corpora.items():
            ids = tok.encode(text, add_special_tokens=False)
            row[f"{corpus}_chars_per_token"] = round(len(text) / len(ids), 3)
            row[f"{corpus}_text_round_trips"] = tok.decode(ids) == text
        same, partial, total = id_round_trips(tok)
        row["ids_round_trip"] = f"{same}/{total}"
        row["ids_partial_utf8"] = partial
        row["the_information"] = tok.convert_ids_to_tokens(tok.encode(" the information", add_special_tokens=False))
        rows.append(row)
    columns = {f"{c} chars/token": f"{c}_chars_per_token" for c in corpora}
    columns["ids round-trip"] = "ids_round_trip"
    columns["partial UTF-8"] = "ids_partial_utf8"
    report(args.out, "tokenizer", columns, rows, corpora={k: len(v) for k, v in corpora.items()})
    print(json.dumps([{k: r[k] for k in ("tokenizer", "the_information")} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
