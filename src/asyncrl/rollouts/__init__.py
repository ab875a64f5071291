"""What the processes that run episodes share, below all of them: the trajectory record (``trajectory``), the
sidecar client (``client``), the reward guard (``scoring``), the context an environment runs episodes with
(``context``), packing into micro-batches (``packing``, the orchestrator's and SFT's) and the metrics means
(``metrics``)."""
