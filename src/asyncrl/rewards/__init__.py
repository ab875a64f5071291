"""Verifiable rewards: scoring in worker processes killed at their deadline (``killable``), math answers
checked symbolically with math-verify (``math``), reasoning-gym's scorers (``reasoning_gym``)."""
