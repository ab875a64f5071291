"""The built-in CPU backend: a transformers engine (batched decoding, KV cache, seeded sampling), run in a
process of its own by default, behind asyncrl's own app (:mod:`asyncrl.inference.server`)."""
