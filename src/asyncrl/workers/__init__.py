"""Where the environments' code runs, out of the orchestrator's event loop, and what isolation each level
gives.

The orchestrator's :class:`~asyncrl.workers.scoring.Scorer` (``scoring``: deadlines, retries, a failure
scores 0, counted by cause) hands every call of an environment's code (a reward, an episode) to one runner
chosen at start, and deeper levels take what the level above cannot bound:

1. :class:`~asyncrl.workers.threads.Threads` (``threads``), ``orchestrator.env_workers.max=0``: reused daemon
   threads of the orchestrator's own process. A reward's deadline is enforced by abandoning it; a reward that
   holds the GIL or crashes the interpreter takes the orchestrator with it. For quick, trusted rewards.
2. :class:`~asyncrl.workers.pool.EnvWorkers` (``pool``, each worker ``process``), the default: a pool of
   worker processes, each with its own copy of the environments and a ``Threads`` of its own. A reward that
   blocks or crashes stalls or kills its worker, which is replaced; the orchestrator's loop never waits on
   environment code.
3. Reward process pools inside a worker (:mod:`asyncrl.rewards.killable`): a scorer that can hang (a symbolic
   check that never ends) runs in a process killed at its deadline, since a thread cannot be stopped. It
   lives with the rewards, which call it directly.
4. The code sandbox (:mod:`asyncrl.sandbox.pool`): a program the policy wrote runs in a pre-warmed bubblewrap
   sandbox (no network, its own PID namespace, bounded memory and time), its verdicts decided outside it, so
   no program can forge a pass or reach its runner. It lives with the sandbox's isolation code.
"""
