"""Figures for the notebooks: a run's training curves, and one metric against one param over experiments.

Each function draws on a new figure (or the ``ax`` given) and returns it; nothing is shown or saved here,
so the same calls work inline in Jupyter and under the Agg backend in tests.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

# (title, column, band column or None): the panels of a run overview, in reading order
CURVES = [
    ("reward", "rollout/reward_mean", "rollout/reward_std"),
    ("loss", "train/loss", None),
    ("mismatch KL (trainer vs inference)", "train/mismatch_kl", None),
    ("staleness (trainer step - rollout policy)", "async/staleness", None),
]


def plot_run_curves(metrics: pd.DataFrame, smooth: int = 1):
    """Reward (mean +- std over the step's samples), loss, mismatch KL and staleness against step, from
    :func:`asyncrl.analysis.runs.load_metrics`. ``smooth > 1`` adds a rolling mean over that many steps
    (staleness is drawn raw: it is a step count). A metric the run did not log leaves its panel empty,
    saying so."""
    if smooth < 1:
        raise ValueError(f"smooth={smooth}: must be >= 1")
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True, layout="constrained")
    for ax, (title, col, band) in zip(axes.flat, CURVES, strict=False):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        series = (
            pd.to_numeric(metrics[col], errors="coerce").dropna()
            if col in metrics
            else pd.Series(dtype=float)
        )
        if series.empty:
            ax.text(0.5, 0.5, f"{col}: not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        if col == "async/staleness":
            ax.step(series.index, series.values, where="post", label=col)
            ax.yaxis.get_major_locator().set_params(integer=True)
        else:
            ax.plot(series.index, series.values, alpha=0.35 if smooth > 1 else 1.0, label=col)
            if smooth > 1:
                ax.plot(
                    series.index,
                    series.rolling(smooth, min_periods=1).mean().values,
                    label=f"rolling mean ({smooth})",
                )
        if band and band in metrics:
            std = pd.to_numeric(metrics[band], errors="coerce").reindex(series.index)
            ax.fill_between(
                series.index, series - std, series + std, alpha=0.15, label=f"+- {band.split('/')[-1]}"
            )
        ax.legend(loc="best", fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    return fig


def plot_metric_vs_param(table: pd.DataFrame, param: str, metric: str, ax=None):
    """``("metrics", metric)`` against ``("params", param)`` of an experiments table, one labelled point per
    experiment, joined in param order when the param is numeric."""
    for group, key in (("params", param), ("metrics", metric)):
        if (group, key) not in table.columns:
            have = list(table[group].columns) if group in table.columns.get_level_values(0) else []
            raise KeyError(f"{group} has no {key!r}; it has {have}")
    data = pd.DataFrame(
        {"x": table[("params", param)], "y": pd.to_numeric(table[("metrics", metric)], errors="coerce")}
    )
    data = data.dropna(subset=["y"])
    numeric = pd.api.types.is_numeric_dtype(data["x"]) and not pd.api.types.is_bool_dtype(data["x"])
    if numeric:
        data = data.sort_values("x")
    else:
        data["x"] = data["x"].astype(str)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    ax.plot(data["x"], data["y"], marker="o", linestyle="-" if numeric else "none")
    for name, row in data.iterrows():
        ax.annotate(
            str(name), (row["x"], row["y"]), textcoords="offset points", xytext=(4, 4), fontsize="small"
        )
    ax.margins(x=0.12, y=0.12)  # room for the labels of the outermost points
    ax.set_xlabel(param)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {param} ({len(data)} experiments)")
    ax.grid(alpha=0.3)
    return ax
