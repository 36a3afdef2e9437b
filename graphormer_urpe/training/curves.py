"""A fit's training curves, drawn from its CSV metrics (``graphormer-urpe-plot curves RUN_DIR``).

A run directory (``--trainer.default_root_dir``) holds its loggers' folders: ``tensorboard/`` and
``csv/``, one ``version_N`` each per run (a resumed fit continues its version). The curves are the
``metrics.csv`` of the newest CSV version over the optimizer step, one panel per quantity
(:func:`panel_of`; the learning rates on a log scale); a step logged twice (a fit resumed from a checkpoint older
than its last logged step) keeps its later value.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

#: the loggers' folders inside a run directory
TENSORBOARD_LOGS = "tensorboard"
CSV_LOGS = "csv"
METRICS_FILE = "metrics.csv"
#: the columns of ``metrics.csv`` that are no metric
_AXES = ("epoch", "step")


def newest_version(logs: Path) -> int | None:
    """The largest ``N`` of the ``version_N`` folders in a logger's folder ``logs``, None without one."""
    versions = [int(p.name[len("version_"):]) for p in logs.glob("version_*")
                if p.is_dir() and p.name[len("version_"):].isdigit()]
    return max(versions, default=None)


def metrics_file(path: Path) -> Path:
    """The ``metrics.csv`` that ``path`` names: the file itself, a ``version_N`` folder, or a run
    directory (its newest CSV version). ``ValueError`` (one line) where there is none."""
    if path.is_file():
        return path
    if (path / METRICS_FILE).is_file():
        return path / METRICS_FILE
    version = newest_version(path / CSV_LOGS)
    if version is not None and (path / CSV_LOGS / f"version_{version}" / METRICS_FILE).is_file():
        return path / CSV_LOGS / f"version_{version}" / METRICS_FILE
    raise ValueError(f"{path}: no {CSV_LOGS}/version_N/{METRICS_FILE} here (give a run directory, "
                     "--trainer.default_root_dir of a fit, or a metrics.csv)")


def read_curves(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` of a ``metrics.csv``, by step; ``ValueError`` (one line) for
    a file that is no CSV of Lightning's CSVLogger."""
    try:
        with open(path, newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: cannot be read as a CSV: {exc}") from None
    if not rows or "step" not in rows[0]:
        raise ValueError(f"{path}: no metrics (a CSVLogger's metrics.csv has a step column and a row per log)")
    points: dict[str, dict[int, float]] = {}
    for row in rows:
        try:
            step = int(float(row["step"]))
        except (TypeError, ValueError):
            continue
        for name, text in row.items():
            if name in _AXES or name is None or not text:
                continue
            try:
                value = float(text)
            except ValueError:
                continue
            if math.isfinite(value):
                points.setdefault(name, {})[step] = value
    return {name: (sorted(by_step), [by_step[s] for s in sorted(by_step)])
            for name, by_step in sorted(points.items())}


def panel_of(name: str) -> str:
    """The panel a metric is drawn in: the learning rates of one optimizer together
    (``lr-AdamW/...``), a quantity of every split together (``train/loss`` and ``val/loss``)."""
    return name.split("/")[0] if name.startswith("lr") else name.split("/")[-1]


def plot_curves(path: Path, out: Path) -> Path:
    """Draw the curves of the run, version folder or ``metrics.csv`` ``path`` into the PNG ``out``
    (needs matplotlib); ``out``. ``ValueError`` (one line) where ``path`` holds no metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = metrics_file(path)
    curves = read_curves(source)
    if not curves:
        raise ValueError(f"{source}: no metric logged yet")
    panels: dict[str, list[str]] = {}
    for name in curves:
        panels.setdefault(panel_of(name), []).append(name)
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (panel, names) in zip(axes[:, 0], panels.items()):
        for name in names:
            steps, values = curves[name]
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_ylabel(panel)
        if panel.startswith("lr") and min(min(curves[n][1]) for n in names) > 0:
            ax.set_yscale("log")
        if len(names) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle(str(source))
    figure.tight_layout()
    save_figure(figure, out, dpi=100)
    return out


def save_figure(figure, path: Path, dpi: int) -> None:
    """``figure`` put in place whole at ``path`` (a stop or a full disk leaves the previous file),
    in the format its suffix names (PNG, ``.png`` appended, without one, as matplotlib does), and closed."""
    import matplotlib.pyplot as plt

    from graphormer_urpe.utils.files import atomic_write

    kind = Path(path).suffix[1:].lower()
    with atomic_write(path if kind else f"{str(path).rstrip('.')}.png", binary=True) as handle:
        figure.savefig(handle, dpi=dpi, format=kind or "png")
    plt.close(figure)
