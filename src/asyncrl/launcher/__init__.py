"""``asyncrl rl``: spawn and supervise the sidecar, orchestrator and trainer (``rl``); process plumbing
(``process``)."""
