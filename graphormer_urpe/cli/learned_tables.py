r"""The learned URPE tables B and C of a checkpoint, drawn (the paper's Figure 2): the pictures
of ``graphormer-urpe-plot CHECKPOINT`` and ``graphormer-urpe-ablation --figures``.

A synthetic-grid sequence model (:func:`plot_sequence`) has per-layer, per-head tables over the
offset ``j - i``, drawn as Toeplitz matrices and as curves; a graph model (:func:`plot_graph`) has
B over shortest-path distance and each layer's effective C, drawn as curves with the
"unreachable" and graph-token slots as points at the right. :func:`plot_learned_tables` draws an
ablation's figure. Needs matplotlib (the ``plot`` extra).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on the training boxes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import CenteredNorm  # noqa: E402

from graphormer_urpe.training.curves import save_figure  # noqa: E402
from graphormer_urpe.training.studies.ablation_results import (  # noqa: E402
    BASELINE, best_run, figure_path, metric_of)

SEQUENCE_TABLE = re.compile(r"(?:^|\.)layers\.(\d+)\.(bias|scale)\.table$")
# The neutral value of each table: B adds, C multiplies.
CENTER = {"bias": 0.0, "scale": 1.0}
SYMBOL = {"bias": "B", "scale": "C"}


def load_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, metadata)`` of a synthetic-grid ``.pt``, a Lightning ``.ckpt`` or a bare
    state_dict, read as plain data (:func:`~graphormer_urpe.utils.torch_files.read_checkpoint`)."""
    from graphormer_urpe.utils.torch_files import read_checkpoint

    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    if "state_dict" in checkpoint:
        meta = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        return dict(checkpoint["state_dict"]), meta
    return dict(checkpoint), {}


# --------------------------------------------------------------------------------------------
# Sequence models
# --------------------------------------------------------------------------------------------
def sequence_tables(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``{"bias": [layers, H, 2M-1], "scale": ...}`` from a :class:`SequenceTransformer`
    state_dict (only the kinds present)."""
    found: dict[str, dict[int, np.ndarray]] = {}
    for key, value in state_dict.items():
        match = SEQUENCE_TABLE.search(key)
        if match:
            found.setdefault(match.group(2), {})[int(match.group(1))] = value.float().numpy()
    return {kind: np.stack([layers[i] for i in sorted(layers)]) for kind, layers in found.items()}


def toeplitz(table: np.ndarray, length: int) -> np.ndarray:
    """``T[i, j] = table[j - i + M - 1]`` for ``i, j < length`` (``table`` is ``[2M - 1]``)."""
    max_len = (table.shape[-1] + 1) // 2
    if not 0 < length <= max_len:
        raise ValueError(f"length {length} is outside [1, {max_len}]")
    pos = np.arange(length)
    return table[pos[None, :] - pos[:, None] + max_len - 1]


def plot_toeplitz(tables: np.ndarray, kind: str, path: Path, length: int | None = None,
                  title: str = "") -> Path:
    """Heatmaps of the Toeplitz matrices, one row per layer and one column per head."""
    num_layers, num_heads, width = tables.shape
    length = length or (width + 1) // 2
    matrices = np.stack([[toeplitz(tables[l, h], length) for h in range(num_heads)]
                         for l in range(num_layers)])
    # a diverging colour scale, symmetric around the table's neutral value
    norm = CenteredNorm(CENTER[kind], max(float(np.abs(matrices - CENTER[kind]).max()), 1e-6))
    fig, axes = plt.subplots(num_layers, num_heads, figsize=(2.2 * num_heads + 1, 2.2 * num_layers),
                             squeeze=False, constrained_layout=True)
    for l in range(num_layers):
        for h in range(num_heads):
            ax = axes[l, h]
            image = ax.imshow(matrices[l, h], cmap="RdBu_r", norm=norm, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if l == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"layer {l}\nquery i", fontsize=9)
            if l == num_layers - 1:
                ax.set_xlabel("key j", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8, label=f"{SYMBOL[kind]}[i, j]")
    fig.suptitle(f"{title}{SYMBOL[kind]} = table[j - i] ({length} x {length})")
    save_figure(fig, path, dpi=110)
    return path


def plot_offset_curves(tables: Mapping[str, np.ndarray], path: Path, max_offset: int | None = None,
                       title: str = "") -> Path:
    """Each table as a curve over the offset ``j - i``: rows = layers, columns = B, C."""
    kinds = [k for k in ("bias", "scale") if k in tables]
    num_layers, num_heads, width = tables[kinds[0]].shape
    max_len = (width + 1) // 2
    max_offset = min(max_offset or max_len - 1, max_len - 1)
    offsets = np.arange(-max_offset, max_offset + 1)
    columns = offsets + max_len - 1
    fig, axes = plt.subplots(num_layers, len(kinds), figsize=(5 * len(kinds), 2.3 * num_layers),
                             squeeze=False, sharex=True, constrained_layout=True)
    for c, kind in enumerate(kinds):
        for l in range(num_layers):
            ax = axes[l, c]
            for h in range(num_heads):
                ax.plot(offsets, tables[kind][l, h, columns], lw=1, label=f"head {h}")
            ax.axhline(CENTER[kind], color="grey", lw=0.5, ls="--")
            ax.set_ylabel(f"layer {l}: {SYMBOL[kind]}")
            if l == num_layers - 1:
                ax.set_xlabel("offset j - i")
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{title}tables over the relative offset")
    save_figure(fig, path, dpi=110)
    return path


def plot_sequence(state_dict: Mapping[str, torch.Tensor], out_dir: Path, stem: str,
                  length: int | None = None, max_offset: int | None = None,
                  title: str = "") -> list[Path]:
    tables = sequence_tables(state_dict)
    if not tables:
        raise ValueError("no relative-position tables (layers.<l>.bias/scale.table) in the "
                         "state_dict: was the model trained with position 'rpe' or 'urpe'?")
    paths = [plot_toeplitz(values, kind, out_dir / f"{stem}-{SYMBOL[kind]}.png", length, title)
             for kind, values in tables.items()]
    paths.append(plot_offset_curves(tables, out_dir / f"{stem}-offsets.png", max_offset, title))
    return paths


# --------------------------------------------------------------------------------------------
# Graph models
# --------------------------------------------------------------------------------------------
def graph_tables(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(B [max_spd + 2, H], C [layers, max_spd + 3, H])`` of a URPE Graphormer, from a
    Lightning checkpoint of :class:`~graphormer_urpe.training.module.GraphormerModule` (the model
    is rebuilt from its hyperparameters; C is :meth:`Graphormer.urpe_scale_tables`). With a
    shared C, only one table is returned."""
    from graphormer_urpe.training.module import load_training_module

    model = load_training_module(path).model
    if model.urpe_scales is None:
        raise ValueError(f"the graph model was trained with attention={model.attention!r}: it has "
                         "no URPE scale C (train with attention 'urpe')")
    return model_tables(model)


def model_tables(model) -> tuple[np.ndarray, np.ndarray | None]:
    """``(B, C)`` of a Graphormer (:func:`graph_tables`); C is None for an RPE model."""
    spatial = model.spatial_bias.embedding.weight.detach().float().numpy()
    if model.urpe_scales is None:
        return spatial, None
    return spatial, model.urpe_scale_tables().numpy()[:len(model.urpe_scales)]


#: The rows of a graph model's table after its distances ``0..max_spd``: B (the spatial bias) has
#: one for unreachable pairs, C (the URPE scale) also one for the graph token's pairs.
SPECIAL_ROWS = {"bias": ["unreach."], "scale": ["unreach.", "graph tok."]}


def plot_spd_panels(panels: Sequence[tuple[str, str, np.ndarray]], path: Path, title: str,
                    max_spd: int | None = None) -> Path:
    """Curves over shortest-path distance, one line per head, one panel per ``(name, kind,
    table)``: ``kind`` "bias" (B, ``[max_spd + 2, H]``) or "scale" (C, ``[max_spd + 3, H]``),
    distances up to ``max_spd`` (default: the table's), the :data:`SPECIAL_ROWS` as separate
    points at the right; the B panels share one y range."""
    table_spd = len(panels[0][2]) - 1 - len(SPECIAL_ROWS[panels[0][1]])
    shown = min(max_spd if max_spd is not None else table_spd, table_spd)
    rows = {kind: list(range(shown + 1)) + [table_spd + 1 + i for i in range(len(extras))]
            for kind, extras in SPECIAL_ROWS.items()}
    bias = [table[rows["bias"]] for _, kind, table in panels if kind == "bias"]
    bias_range = (min(t.min() for t in bias), max(t.max() for t in bias)) if bias else None
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.6 * nrows), squeeze=False,
                             constrained_layout=True)
    distances = np.arange(shown + 1)
    ticks = list(range(0, shown + 1, max(1, shown // 5)))
    for index, (ax, (name, kind, table)) in enumerate(zip(axes.flat, panels)):
        num_heads = table.shape[1]
        extras = SPECIAL_ROWS[kind]
        colors = plt.cm.viridis(np.linspace(0, 1, num_heads))
        special_x = shown + 2 + np.arange(len(extras))
        for h in range(num_heads):
            ax.plot(distances, table[: shown + 1, h], color=colors[h], lw=1, label=f"head {h}")
            ax.scatter(special_x, table[table_spd + 1: table_spd + 1 + len(extras), h],
                       color=colors[h], s=8)
        ax.axhline(CENTER[kind], color="grey", lw=0.5, ls="--")
        if kind == "bias" and bias_range is not None:
            ax.set_ylim(bias_range[0] - 0.05, bias_range[1] + 0.05)
        ax.set_title(name, fontsize=8)
        ax.set_xticks(ticks + list(special_x))
        ax.set_xticklabels([str(t) for t in ticks] + extras, fontsize=7, rotation=45)
        ax.set_xlabel("shortest-path distance", fontsize=8)
        if index == 0 and num_heads <= 8:
            ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    save_figure(fig, path, dpi=110)
    return path


def plot_graph(path: Path, out_dir: Path, stem: str,
               max_spd: int | None = None, title: str = "") -> list[Path]:
    """Curves over SPD per head: one panel for B (shared by the layers) and one per layer's C."""
    spatial, scales = graph_tables(path)
    panels = [("B (spatial bias)", "bias", spatial)] + [
        (f"C, layer {l}" if len(scales) > 1 else "C (all layers)", "scale", scales[l])
        for l in range(len(scales))]
    return [plot_spd_panels(panels, out_dir / f"{stem}-spd.png",
                            f"{title}URPE over SPD ({scales.shape[2]} heads, one line each)", max_spd)]


# --------------------------------------------------------------------------------------------
def plot_checkpoint(path: Path, out_dir: Path, length: int | None = None,
                    max_offset: int | None = None, max_spd: int | None = None) -> list[Path]:
    """Write the figures of a sequence-model or graph-model checkpoint; returns the PNGs."""
    state_dict, meta = load_state_dict(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = path.stem
    if any(SEQUENCE_TABLE.search(k) for k in state_dict):
        title = ""
        if "task" in meta:
            result = meta.get("result", {})
            title = (f"{meta['task']} V={meta['vocab_size']} {meta['scheme']} seed={meta['seed']}"
                     f" (acc {100 * result.get('accuracy', float('nan')):.1f}%): ")
        return plot_sequence(state_dict, out_dir, stem, length, max_offset, title)
    if "hyper_parameters" in meta:
        return plot_graph(path, out_dir, stem, max_spd)
    raise ValueError(f"{path}: found neither sequence tables (layers.<l>.scale.table) nor a "
                     "Lightning checkpoint of a graph model (hyper_parameters and state_dict)")


def plot_learned_tables(entries: Sequence[dict], runs_dir: Path, out_dir: Path,
                        max_spd: int = 21) -> Path:
    """``<out_dir>/<recipe>-tables.png`` (:func:`~graphormer_urpe.training.studies.ablation_results.figure_path`):
    over shortest-path distance, one line per head, the spatial bias B of the URPE run with the
    best validation metric (:func:`~graphormer_urpe.training.studies.ablation_results.best_run`)
    and of the RPE run with the same seed (same y axis), then that URPE run's scale C of every
    layer, for distances up to ``max_spd`` (ZINC-12k's largest). Checkpoints are the runs' best
    validation ones, in ``runs_dir/<recipe>/<arm>-s<seed>``."""
    from graphormer_urpe.prediction.load import best_checkpoint
    from graphormer_urpe.training.module import load_training_module

    urpe = best_run(entries)
    if urpe is None:
        raise ValueError("no finished urpe run to plot")
    recipe, seed, metric = urpe["recipe"], urpe["seed"], metric_of(urpe)
    rpe = next((e for e in entries if e["attention"] == BASELINE and e["seed"] == seed
                and e["recipe"] == recipe), None)
    tables = {arm: model_tables(load_training_module(best_checkpoint(runs_dir / recipe / f"{arm}-s{seed}")[0]).model)
              for arm in ["urpe"] + ([BASELINE] if rpe else [])}
    panels = [(f"B, {arm} (val {e[f'val_{metric}']:.3f}, test {e[f'test_{metric}']:.3f})", "bias", tables[arm][0])
              for arm, e in (("urpe", urpe), (BASELINE, rpe)) if e is not None]
    panels += [(f"C, urpe layer {layer}", "scale", table) for layer, table in enumerate(tables["urpe"][1])]
    return plot_spd_panels(panels, figure_path(out_dir, recipe),
                           f"{recipe}, seed {seed}: best-validation checkpoints, one line per head",
                           max_spd)
