"""asyncrl: asynchronous reinforcement learning of LLMs (trainer + inference sidecar + orchestrator)."""

__version__ = "0.1.0"
