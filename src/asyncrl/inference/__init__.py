"""The inference sidecar. What both backends share lives here: the request and answer models (``protocol``),
errors in OpenAI's shape (``errors``), the admin routes and their checks (``admin``, ``admin_routes``),
the rollout-scoped OpenAI endpoints that record an agent's calls (``recording``), the ASGI plumbing their
middleware uses (``asgi``), and ``serve``, which chooses a backend at start. The built-in CPU backend, its
engine and its own app are in ``builtin``; the vLLM backend (vLLM's app with asyncrl's routes and plugins,
and the checks a weights update passes before it reaches vLLM's workers) in ``vllm``."""
