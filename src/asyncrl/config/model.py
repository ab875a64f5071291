"""Config of the policy: which model, its dtype, the tiny default's architecture, LoRA.

Torch-free: the CLI imports it to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in ``conf/``
only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from asyncrl.config.fields import ConfigError, F

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TinyModelConfig:
    """Architecture that ``asyncrl prepare`` initialises randomly and saves at ``model.name``."""

    build: bool = F(
        False, "`asyncrl prepare` builds this random-init model (and its tokenizer) at model.name"
    )
    architecture: str = F(
        "Qwen3ForCausalLM",
        "transformers architecture class (Qwen3MoeForCausalLM: a mixture of experts, see num_experts)",
        choices=("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"),
    )
    hidden_size: int = F(128, "hidden width", ge=8)
    intermediate_size: int = F(384, "MLP width", ge=8)
    num_hidden_layers: int = F(3, "decoder layers", ge=1)
    num_attention_heads: int = F(4, "query heads", ge=1)
    num_key_value_heads: int = F(2, "key/value heads (grouped-query attention)", ge=1)
    head_dim: int = F(32, "per-head width", ge=4)
    max_position_embeddings: int = F(512, "longest sequence the model accepts", ge=16)
    tie_word_embeddings: bool = F(True, "share input and output embeddings")
    charset: str = F(
        "ascii_printable",
        "characters of the local character-level tokenizer",
        choices=("ascii_lowercase", "ascii_printable"),
    )
    tokenizer: str = F(
        "char",
        "the tokenizer built with it: 'char', one token per character of charset; 'qwen3', Qwen3's own "
        "byte-level BPE (151,669 ids; `python -m asyncrl.models.qwen_tokenizer` writes it once per machine, "
        "make install does); 'byte_bpe', shape-only: a byte-level BPE of exactly vocab_size ids with "
        "made-up merges (a real vocabulary's size and id range, not its lengths: about half as many "
        "characters a token as Qwen3's)",
        choices=("char", "qwen3", "byte_bpe"),
    )
    vocab_size: int = F(
        0,
        "embedding rows; 0 = the tokenizer's size; with tokenizer=byte_bpe, the tokenizer's size too",
        ge=0,
    )
    num_experts: int = F(8, "experts of each MoE layer (architecture=Qwen3MoeForCausalLM only)", ge=2)
    num_experts_per_tok: int = F(2, "experts each token is routed to, top-k of the router (MoE only)", ge=1)
    moe_intermediate_size: int = F(64, "MLP width of each expert (MoE only)", ge=8)
    norm_topk_prob: bool = F(
        True,
        "renormalise the top-k routing probabilities to sum to 1, as Qwen3-MoE checkpoints do (MoE only)",
    )

    @property
    def is_moe(self) -> bool:
        return self.architecture == "Qwen3MoeForCausalLM"


@dataclass
class LoRAConfig:
    enabled: bool = F(
        False,
        "train LoRA adapters (peft) instead of every weight; the hand-off is the adapter, which vLLM loads "
        "as a LoRA and the built-in sidecar merges on load",
    )
    r: int = F(16, "adapter rank", ge=1)
    alpha: int = F(32, "scale numerator: the update is (alpha / r) * B @ A", ge=1)
    dropout: float = F(
        0.0,
        "dropout on the adapter's input while training (> 0: trainer and sidecar logprobs differ)",
        ge=0,
        lt=1,
    )
    target_modules: List[str] = F(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "linear layers adapted, by name suffix (PRIME-RL's default)",
    )


@dataclass
class ModelConfig:
    name: str = F("outputs/models/tiny", "starting policy: a Hugging Face id or a local HF directory")
    tokenizer: Optional[str] = F(None, "tokenizer id or directory; null = same as model.name")
    dtype: str = F("float32", "weights dtype for training and inference", choices=DTYPES)
    attn_implementation: str = F(
        "sdpa",
        "attention kernel; 'auto' = the fastest the loading process can run (varlen_fa4 for training on "
        "Hopper+ with flash-attn-4 installed, else varlen on a GPU; sdpa on the CPU, under context "
        "parallelism and in the built-in sidecar); 'varlen' = torch's flash varlen kernel on packed rows "
        "(GPU, see models/attention.py), 'varlen_fa4' = flash-attn-4's kernel there (Hopper+, as custom ops "
        "a compiled layer keeps whole); flash_attention_2/3/4 = the flash-attn, flash-attn-3 or "
        "flash-attn-4 package (4: training only, transformers decodes with it without a KV cache kernel)",
        choices=(
            "auto",
            "sdpa",
            "eager",
            "varlen",
            "varlen_fa4",
            "flex_attention",
            "flash_attention_2",
            "flash_attention_3",
            "flash_attention_4",
        ),
    )
    trust_remote_code: bool = F(False, "allow model code from the checkpoint directory")
    init: TinyModelConfig = F(TinyModelConfig(), "random-init architecture built by `asyncrl prepare`")
    lora: LoRAConfig = F(LoRAConfig(), "LoRA adapters instead of full fine-tuning (RL and SFT)")


def is_local_path(name: str) -> bool:
    """A directory path rather than a hub id (``org/name``): absolute, relative with ``.``/``~``, or
    more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def check_model_source(cfg: ModelConfig) -> None:
    """Fail early, naming the key, when ``model.name`` or ``model.tokenizer`` is a local path with no
    model."""
    for key, name in (("model.name", cfg.name), ("model.tokenizer", cfg.tokenizer)):
        if (
            name
            and is_local_path(name)
            and not (Path(name).expanduser() / "config.json").exists()
            and not (
                key == "model.tokenizer" and (Path(name).expanduser() / "tokenizer_config.json").exists()
            )
        ):
            hint = "; run `asyncrl prepare` to build the tiny default" if cfg.init.build else ""
            raise ConfigError(f"invalid config:\n  {key}={name!r} is a path with no model in it{hint}")
