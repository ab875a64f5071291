"""Verifiable rewards: scoring that runs in worker processes with a time bound (``workers``), math answers
checked symbolically with math-verify (``math``), reasoning-gym's scorers (``reasoning_gym``)."""
