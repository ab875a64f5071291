"""RL losses' policy terms, one module per ``trainer.loss.type`` (:mod:`asyncrl.losses.base` says what a loss
is)."""
