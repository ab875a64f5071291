"""Hand-offs between processes through the run directory: rollouts (orchestrator -> trainer) and
weights (trainer -> sidecar). Both are directories written atomically with a STABLE marker last."""
