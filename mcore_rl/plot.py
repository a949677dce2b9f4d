"""PNG curves from a run's metrics.jsonl (matplotlib Agg: no display needed).

`plot_run(run_dir)` writes RUN_DIR/plots/overview.png (one panel per metric group that changes over the run; the
metrics constant for the whole run are named under the panels: `informative`) and one PNG per numeric metric, constant
or not; it returns the paths written. `part=(i, n)`: this call writes the i-th of n
shares (the trainer's ranks write the plots together: ~40 PNGs took one process 4-5 s of CPU at a run's end).
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from pathlib import Path

from mcore_rl.metrics import read_metrics

# (panel title, name pattern); a metric goes to the first group it matches, in this order.
GROUPS: tuple[tuple[str, str], ...] = (
    ("reward", r"reward|pass@|accuracy"),
    ("response length", r"response_len|length"),
    ("tokens / s", r"tokens_per_s|throughput"),
    ("loss", r"loss"),
    ("KL", r"kl"),
    ("entropy", r"entropy"),
    ("clip fractions", r"clipfrac"),
    ("grad norm", r"grad_norm"),
    ("train / rollout mismatch", r"mismatch|is_weight"),
    ("staleness (weight versions)", r"staleness"),  # separate placement: behaviour policy behind the update
    ("seconds each role waits", r"^time/.*_wait$"),  # separate placement: actor for samples, rollout for weights
    ("seconds per phase", r"^time/"),  # metrics.PhaseTimer: time/rollout, time/update, time/sync, ...
    ("prompt groups", r"^groups/"),  # all correct / all wrong: the groups without signal
    ("engine vs actor log-prob gap", r"^sync/(verify|calibration)_\w*diff$"),  # nats, weight_sync/verify.py
)
SKIP = {"step", "time"}


def numeric_series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) for every numeric metric (finite values only)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        step = r.get("step")
        for key, value in r.items():
            if (
                key in SKIP
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(float(value))
    return series


def group_metrics(keys) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        title = next((t for t, pattern in GROUPS if re.search(pattern, key)), key)
        groups.setdefault(title, []).append(key)
    order = [t for t, _ in GROUPS]
    return dict(sorted(groups.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def informative(
    series: dict[str, tuple[list[int], list[float]]],
) -> tuple[dict[str, tuple[list[int], list[float]]], dict[str, float]]:
    """(the metrics the overview draws, the constant ones with their value). A metric with one value all run (KL
    without a reference, clip fractions of 0, a constant lr, update_successful; or one logged once, like the first
    sync's calibration) draws a flat line or a dot that says no more than its value, so it is named under the
    panels instead; its own PNG is written all the same. A run where nothing changes (one step) shows everything."""
    constant = {key: ys[0] for key, (xs, ys) in series.items() if len(set(ys)) == 1}
    if len(constant) == len(series):
        return series, {}
    return {key: s for key, s in series.items() if key not in constant}, constant


def _constant_line(constant: dict[str, float], cols: int) -> str:
    items = ", ".join(f"{key} {value:.4g}" for key, value in sorted(constant.items()))
    return textwrap.fill(f"constant over the run (each in its own PNG): {items}", width=60 * cols)


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def overview_figure(series: dict[str, tuple[list[int], list[float]]], title: str):
    """One panel per group of the metrics that change over the run (`informative`), the constant ones named below
    them, the run's name above them (constrained layout keeps it clear of the panels' titles, which tight_layout
    does not)."""
    plt = _pyplot()

    series, constant = informative(series)
    groups = group_metrics(series)
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False, layout="constrained")
    for ax, (name, keys) in zip(axes.flat, groups.items()):
        for key in keys:
            xs, ys = series[key]
            ax.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 or keys[0] != name:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    fig.suptitle(title)
    if constant:
        fig.supxlabel(_constant_line(constant, cols), fontsize=8)
    return fig


OVERVIEW_COST_PER_PANEL = 3  # the overview's cost in per-metric PNGs, per panel (measured: ~33 PNGs for 10 panels)


def share(keys: list[str], panels: int, part: tuple[int, int]) -> list[str]:
    """The metrics whose PNGs part (index, count) writes: part 0 writes the overview too, and the PNGs go one by
    one to the part with the least work so far, so that the parts take about as long."""
    index, count = part
    load = [0] * count
    load[0] = panels * OVERVIEW_COST_PER_PANEL
    mine = []
    for key in keys:
        least = load.index(min(load))
        load[least] += 1
        if least == index:
            mine.append(key)
    return mine


def plot_run(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, part: tuple[int, int] = (0, 1)
) -> list[Path]:
    """The plots of `run_dir`; with part=(index, count) only this share (`share`): the overview at index 0 and
    some of the metrics' PNGs. The paths written, the overview first when written."""
    index, count = part
    if not 0 <= index < count:
        raise ValueError(f"plot part {index} of {count}: the index must be in 0 .. {count - 1}")
    plt = _pyplot()

    run_dir = Path(run_dir)
    series = numeric_series(read_metrics(run_dir))
    if not series:
        raise ValueError(f"no numeric metrics in {run_dir}/metrics.jsonl: is this a run directory of a started run?")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    if index == 0:
        fig = overview_figure(series, run_dir.name)
        path = out / "overview.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for key in share(sorted(series), len(group_metrics(informative(series)[0])), part):
        xs, ys = series[key]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{_safe_name(key)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
