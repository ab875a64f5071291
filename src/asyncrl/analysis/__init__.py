"""Analysis of runs and experiments, for the notebooks in ``notebooks/`` (and any script).

- :mod:`.runs` reads a run directory (the layout of :mod:`asyncrl.paths`): per-step metrics of the
  orchestrator and the trainer as one table, the saved samples, and the best and worst of them per step.
- :mod:`.experiments` turns ``dvc exp show --json`` into a table of experiments (params and metrics).
- :mod:`.plots` draws both with matplotlib.

The loaders are pure functions returning pandas DataFrames, so the notebooks stay thin and the logic is
unit-tested. pandas and matplotlib come with the ``notebooks`` extra; nothing else in asyncrl imports
this package.
"""
