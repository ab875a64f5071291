"""The inference sidecar. What both backends share lives here: the request and answer models (``protocol``),
errors in OpenAI's shape (``errors``), the admin routes and their checks (``admin``, ``admin_routes``,
``weights_check``), and ``serve``, which chooses a backend at start. The built-in CPU backend, its engine and
its own app are in ``builtin``; the vLLM backend (vLLM's app with asyncrl's routes and plugins) in
``vllm``."""
