"""Fabric trainers: RL (``rl``), SFT warmup (``sft``), their shared pieces (``common``) and losses
(``loss``)."""
