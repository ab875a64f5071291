"""The inference sidecar. The protocol and the routes both backends serve live here (``protocol``, ``errors``,
``limits``, ``admin``, ``admin_routes``, ``routes``, ``rendering``, ``streaming``); the built-in CPU backend in
``builtin`` (its app: ``server``), the vLLM backend in ``vllm``; ``serve`` chooses one at start."""
