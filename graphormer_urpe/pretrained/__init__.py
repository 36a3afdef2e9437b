"""Backbones trained by this project and shipped inside the package (weights only, no code).

``--model.init_from pretrained:<name>`` starts a run from one of :data:`MODELS` (resolved here,
nothing is downloaded); ``docs/pretrained.md`` is each one's model card. :func:`export` writes
such a file from a training checkpoint: the backbone's tensors and the hyperparameters that say
what they fit (architecture, featurizer, ``max_hops``), nothing else.

    python -m graphormer_urpe.pretrained RUN/checkpoints/BEST.ckpt OUT.pt
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: How ``init_from`` names a shipped backbone.
PREFIX = "pretrained:"
#: ``{name: file in this folder}``.
MODELS = {"zinc-descriptors": "zinc-descriptors.pt"}
#: The export command's name in its messages.
PROG = "python -m graphormer_urpe.pretrained"


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
    return Path(__file__).with_name(MODELS[name])


def export(checkpoint: str | Path, out: str | Path) -> dict:
    """Write ``checkpoint``'s backbone (float32 tensors, the output head included) and its
    hyperparameters (without ``init_from``) to ``out``, whole or not at all (a temporary file
    beside it, renamed: a full disk leaves a previous ``out`` as it was); returns what was
    written. One-line ``ValueError`` (a :class:`CheckpointError` for the checkpoint) before
    anything is written when ``out`` is the checkpoint (any spelling, a link), ``out``'s folder
    is missing or ``out`` a directory, or ``checkpoint`` is no training checkpoint (missing, a
    directory, not a PyTorch archive, or a file without a model's weights, such as an exported
    backbone)."""
    from graphormer_urpe.checkpoint import CheckpointError, read_checkpoint
    from graphormer_urpe.files import check_writable_dir, refuse_overwriting_inputs, save_torch

    checkpoint, out = Path(checkpoint), Path(out)
    if out.is_dir():
        raise ValueError(f"out {out} is a directory; name the file to write")
    if not out.parent.is_dir():
        raise ValueError(f"out {out}: its folder {out.parent} does not exist")
    refuse_overwriting_inputs("out", [out], [("checkpoint", "training checkpoint", checkpoint)])
    check_writable_dir(out.parent, "out")
    saved = read_checkpoint(checkpoint)
    weights = saved.get("state_dict") if isinstance(saved, dict) else None
    if not isinstance(weights, dict) or not any(k.startswith("model.") for k in weights):
        raise CheckpointError(f"checkpoint {checkpoint} is not a training checkpoint: it has no model "
                              "weights (state_dict 'model.*'); an exported backbone is exported already")
    state = {k.removeprefix("model."): v.float().contiguous() if v.is_floating_point() else v
             for k, v in weights.items() if k.startswith("model.")}
    hparams = {k: v for k, v in (saved.get("hyper_parameters") or {}).items() if k != "init_from"}
    content = {"state_dict": state, "hyper_parameters": hparams,
               "trained": {"global_step": int(saved.get("global_step", 0)), "source": checkpoint.name}}
    save_torch(content, out)  # a full disk: OSError (ENOSPC), one line from run_command
    return content


def main(argv: list[str] | None = None) -> int:
    """The command: exit status 0; 2 for a refused input or output (one line naming it, before
    anything is written); 1 for a full disk (one line; a previous ``out`` stays as it was)."""
    from graphormer_urpe.files import run_command

    parser = argparse.ArgumentParser(prog=PROG, description="Write a training checkpoint's backbone as "
                                                            "a weights-only file.")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    return run_command(PROG, lambda: _export(args.checkpoint, args.out))


def _export(checkpoint: Path, out: Path) -> int:
    try:
        content = export(checkpoint, out)
    except ValueError as exc:  # CheckpointError too
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    size = sum(t.numel() for t in content["state_dict"].values())
    print(f"{out}: {len(content['state_dict'])} tensors, {size:,} numbers, "
          f"{out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
