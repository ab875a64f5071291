"""Evaluation: an environment's eval split against a model (``main``), with pass@k (``metrics``)."""
