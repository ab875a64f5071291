"""Qwen3's tokenizer without the model hub, for the models of the GPU shapes
(``model.init.tokenizer=qwen3``).

Qwen2, Qwen2.5 and Qwen3 share one byte-level BPE: 151,643 regular ids, 151,387 merges, Qwen's pre-tokenizer
pattern and NFC. llama.cpp keeps it as a vocab-only test file, ``models/ggml-vocab-qwen2.gguf``, which ships
in llama-cpp-python's source distribution on PyPI (:data:`SDIST`, pinned by its sha256); transformers' own
GGUF metadata reader and its Qwen2 converter turn the file's tokens, merges and pre-tokenizer name into a
tokenizers model. llama.cpp's own test strings and the ids it expects for them
(``ggml-vocab-qwen2.gguf.inp`` / ``.out``, in the same archive) are checked, every one, before the result is
kept. The file holds the three special tokens of the first Qwen2 release and padding names above them;
Qwen3's 26 added tokens (151,643-151,668) take their place, as in Qwen3's own ``tokenizer.json``, and the
chat template is ChatML without a default system prompt.

    python -m asyncrl.models.qwen_tokenizer        # once per machine (make install runs it): a 76 MB
    download

It is written to ``$ASYNCRL_TOKENIZERS/qwen3`` (default ``~/.cache/asyncrl/tokenizers``), atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from asyncrl.config.fields import ConfigError
from asyncrl.utils.atomic import atomic_dir

SDIST = ("llama-cpp-python==0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
TEST_IDS = ("ggml-vocab-qwen2.gguf.inp", "ggml-vocab-qwen2.gguf.out")  # llama.cpp's test strings, their ids
REGULAR = 151_643  # ids below are the BPE's; Qwen3's added tokens follow
# Qwen3's added tokens in id order from 151,643, and whether each is special (skipped when decoding with
# skip_special_tokens), as in Qwen3's tokenizer_config.json
ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]  # fmt: skip
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_dir() -> Path:
    return (
        Path(os.environ.get("ASYNCRL_TOKENIZERS") or Path.home() / ".cache" / "asyncrl" / "tokenizers")
        / "qwen3"
    )


def load_qwen3_tokenizer():
    """The tokenizer written by :func:`fetch`; a :class:`ConfigError` naming the command when it is
    missing."""
    path = tokenizer_dir()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"invalid config:\n  model.init.tokenizer=qwen3: no tokenizer at {path}; run `python -m "
            "asyncrl.models.qwen_tokenizer` once on this machine (make install does; it "
            "downloads llama-cpp-python's source archive from PyPI), or set "
            "ASYNCRL_TOKENIZERS to where one was written"
        )
    # `make install` runs this module on every call to ask whether the tokenizer is there; 0.1 s of CPU
    # lazy: without transformers, 3.5 with (`time python -m asyncrl.models.qwen_tokenizer`)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def fetch(out: Path) -> Path:
    """Download, convert, check and write the tokenizer to ``out`` (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "req.txt").write_text(f"{SDIST[0]} --hash=sha256:{SDIST[1]}\n")
        pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "--require-hashes", "-r",
                        str(work / "req.txt"), "-d", str(work)], check=True)  # fmt: skip
        (archive,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(archive) as tar:
            for suffix in ("", ".inp", ".out"):
                member = tar.getmember(MEMBER + suffix)
                member.name = Path(member.name).name
                tar.extract(member, work, filter="data")
        tokenizer = convert(work / Path(MEMBER).name)
        if problems := check_ids(tokenizer, work / TEST_IDS[0], work / TEST_IDS[1]):
            raise RuntimeError(f"the converted tokenizer does not give llama.cpp's ids for {problems[:3]}")
        with atomic_dir(out) as tmp_out:
            tokenizer.save_pretrained(tmp_out)
            # one line: 5.4 MB where the indented file is 11.4 (it travels to the GPU machine beside the vLLM
            # bundle)
            tokenizer.backend_tokenizer.save(str(tmp_out / "tokenizer.json"), pretty=False)
            for (
                name
                # kept beside it, so that the check can be run again (tests/unit/test_qwen_tokenizer.py)
            ) in TEST_IDS:
                shutil.copy(work / name, tmp_out / name)
            (tmp_out / "SOURCE.json").write_text(
                json.dumps({"sdist": SDIST[0], "sha256": SDIST[1], "file": MEMBER})
            )
    return out


def convert(gguf_file: Path):
    """The GGUF's tokenizer, with Qwen3's added tokens in place of the file's own and ChatML.

    The file's metadata goes straight to transformers' Qwen2 converter, as
    ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` does after parsing the file twice with the ``gguf``
    package's reader: the same ``tokenizer.json``, byte for byte; the whole command takes 12 s of CPU instead
    of 32 (``/usr/bin/time python -m asyncrl.models.qwen_tokenizer --out /tmp/q --force``)."""
    # lazy: as in load_qwen3_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast  # lazy: as above
    from transformers.integrations import ggml, gguf  # lazy: as above

    metadata, _ = gguf.read_gguf_metadata(str(gguf_file), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    if metadata["general.architecture"] != "qwen2":
        raise ValueError(f"{gguf_file}: a {metadata['general.architecture']!r} vocabulary, not Qwen2's")
    renames = ggml.GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {
        name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata
    }
    backend, _ = ggml.convert_gguf_tokenizer("qwen2", fields)
    data = json.loads(backend.to_str())
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < REGULAR}
    data["added_tokens"] = [
        {"id": REGULAR + k, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for k, (text, special) in enumerate(ADDED)
    ]  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def check_ids(tokenizer, inp: Path, out: Path) -> list[str]:
    """llama.cpp's test strings whose ids differ from the ones it expects (``.inp``: strings separated by its
    marker line; ``.out``: one line of ids per string)."""
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = [[int(i) for i in line.split()] for line in out.read_text(encoding="utf-8").splitlines()]
    if len(expected) != len(texts) - 1:  # the file ends with the marker
        return [f"{len(texts) - 1} strings, {len(expected)} lines of ids"]
    pairs = zip(texts[:-1], expected, strict=True)
    return [repr(t[:30]) for t, ids in pairs if tokenizer.encode(t, add_special_tokens=False) != ids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="where to write it (default: $ASYNCRL_TOKENIZERS/qwen3)"
    )
    ap.add_argument("--force", action="store_true", help="write it again even if it is there")
    args = ap.parse_args(argv)
    out = args.out or tokenizer_dir()
    if (out / "tokenizer.json").is_file() and not args.force:
        print(f"{out}: already there")
        return 0
    print(f"{fetch(out)}: Qwen3's tokenizer, checked against llama.cpp's test ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
