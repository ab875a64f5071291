"""The vLLM backend: vLLM's OpenAI server with asyncrl's routes, its worker extension for weight updates and
the checks an update passes first (``weights_check``, torch-free), the deferred-logprobs processor and the
numerics=bitwise plugin. vLLM is imported only where it runs: the CPU install has none."""
