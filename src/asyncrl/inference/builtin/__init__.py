"""The built-in CPU backend: a transformers engine (batched decoding, KV cache, seeded sampling), run in a
process of its own by default, behind asyncrl's own app (``server``: the OpenAI routes in ``routes``, chat
rendering, streaming, request limits and admission; the engine in ``engine``, ``engine_process``,
``batcher``)."""
