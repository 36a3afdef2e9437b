"""Backbones trained by this project and shipped inside the package (weights only, no code).

``--model.init_from pretrained:<name>`` starts a run from one of :data:`MODELS` (resolved here,
nothing is downloaded); ``docs/pretrained.md`` is each one's model card. :func:`export` writes
such a file from a training checkpoint: the backbone's tensors and the hyperparameters that say
what they fit (architecture, featurizer, ``max_hops``), nothing else.

    python -m graphormer_urpe.pretrained RUN/checkpoints/BEST.ckpt OUT.pt
"""
from __future__ import annotations

import argparse
from pathlib import Path

#: How ``init_from`` names a shipped backbone.
PREFIX = "pretrained:"
#: ``{name: file in this folder}``.
MODELS = {"zinc-descriptors": "zinc-descriptors.pt"}


def resolve(source: str | Path) -> Path:
    """The file ``source`` names: a shipped backbone for ``pretrained:<name>``, else the path
    itself. ``ValueError`` (one line) for an unknown name."""
    text = str(source)
    if not text.startswith(PREFIX):
        return Path(source)
    name = text[len(PREFIX):]
    if name not in MODELS:
        raise ValueError(f"model.init_from: no shipped backbone {name!r} (shipped: "
                         f"{', '.join(PREFIX + n for n in MODELS)})")
    return Path(__file__).with_name(MODELS[name])


def export(checkpoint: str | Path, out: str | Path) -> dict:
    """Write ``checkpoint``'s backbone (float32 tensors, the output head included) and its
    hyperparameters (without ``init_from``) to ``out``; returns what was written."""
    import torch

    from graphormer_urpe.checkpoint import read_checkpoint

    saved = read_checkpoint(Path(checkpoint))
    state = {k.removeprefix("model."): v.float().contiguous() if v.is_floating_point() else v
             for k, v in saved["state_dict"].items() if k.startswith("model.")}
    hparams = {k: v for k, v in (saved.get("hyper_parameters") or {}).items() if k != "init_from"}
    content = {"state_dict": state, "hyper_parameters": hparams,
               "trained": {"global_step": int(saved.get("global_step", 0)), "source": Path(checkpoint).name}}
    torch.save(content, out)
    return content


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graphormer_urpe.pretrained",
                                     description="Write a training checkpoint's backbone as a weights-only file.")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    content = export(args.checkpoint, args.out)
    size = sum(t.numel() for t in content["state_dict"].values())
    print(f"{args.out}: {len(content['state_dict'])} tensors, {size:,} numbers, "
          f"{args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
