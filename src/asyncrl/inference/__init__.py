"""The inference sidecar: engines (``engine``), the HTTP API (``server``, ``protocol``), the client (``client``)."""
