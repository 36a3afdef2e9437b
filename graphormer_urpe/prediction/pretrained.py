"""Backbones trained by this project and shipped inside the package (weights only, no code).

``--model.init_from pretrained:<name>`` starts a run from one of :data:`MODELS` (resolved here,
nothing is downloaded); ``docs/pretrained.md`` is each one's model card. Such a file is written
from a training checkpoint by ``graphormer-urpe-export RUN/checkpoints/BEST.ckpt OUT.pt``
(:mod:`graphormer_urpe.cli.export`).
"""
from __future__ import annotations

from pathlib import Path

#: How ``init_from`` names a shipped backbone.
PREFIX = "pretrained:"
#: The folder of the shipped weights (package data, no code).
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "pretrained"
#: ``{name: file in WEIGHTS_DIR}``.
MODELS = {"zinc-descriptors": "zinc-descriptors.pt"}


def resolve(source: str | Path, option: str = "model.init_from") -> Path:
    """The file ``source`` names: a shipped backbone for ``pretrained:<name>``, else the path
    itself. ``ValueError`` (one line, naming ``option``) for an unknown name."""
    text = str(source)
    if not text.startswith(PREFIX):
        return Path(source)
    name = text[len(PREFIX):]
    if name not in MODELS:
        raise ValueError(f"{option}: no shipped backbone {name!r} (shipped: "
                         f"{', '.join(PREFIX + n for n in MODELS)})")
    return WEIGHTS_DIR / MODELS[name]
