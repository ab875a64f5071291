"""Policies and tokenizers, below the three processes.

``hf``: load any HF model id or directory, build the embedded tiny default, render chat prompts (imports
torch and transformers); ``tokenizer_files``: what the orchestrator needs from a tokenizer, read from its
files without torch; ``attention``, ``fa4``, ``bitwise``, ``vllm_kernels``: kernels; ``lora``, ``gguf``,
``logprobs``, ``truncation`` (the top-k / top-p / min-p rule the sampler and the trainer share). This module
imports nothing, so a torch-free process can use a torch-free submodule.
"""
