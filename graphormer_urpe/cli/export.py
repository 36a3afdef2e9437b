"""``graphormer-urpe-export CHECKPOINT OUT``: a training checkpoint's backbone as a weights-only
file, for ``--model.init_from`` (:func:`export`).

The file holds the backbone's tensors (float32, the output head included), the hyperparameters
that say what they fit (architecture, featurizer, ``max_hops``; without ``init_from``) and
:data:`EXPORT_RECORD`, nothing else: the form of the backbones shipped in the package
(:mod:`graphormer_urpe.prediction.pretrained`), which ``graphormer-urpe-predict`` loads too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphormer_urpe.utils.process import run_command

PROG = "graphormer-urpe-export"
#: The key of an exported backbone that says what it was exported from (its steps, its file).
EXPORT_RECORD = "trained"


def main(argv: list[str] | None = None) -> int:
    """The command: exit status 0; 2 for a refused input or output (one line naming it, before
    anything is written); 1 for a full disk (one line; a previous ``out`` stays as it was)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Write a training checkpoint's backbone as "
                                                            "a weights-only file.")
    parser.add_argument("checkpoint", type=Path,
                        help="a training checkpoint of graphormer-urpe fit (.ckpt), e.g. a run's checkpoints/last.ckpt")
    parser.add_argument("out", type=Path,
                        help="the weights-only file to write (a new file, or an earlier export it replaces)")
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


def is_export(content: object) -> bool:
    """Whether ``content`` (a torch file read as data) is a backbone :func:`export` wrote: its
    tensors, its hyperparameters and :data:`EXPORT_RECORD`, nothing else."""
    return (isinstance(content, dict) and set(content) == {"state_dict", "hyper_parameters", EXPORT_RECORD}
            and isinstance(content["state_dict"], dict)
            and not any(str(key).startswith("model.") for key in content["state_dict"]))


def export(checkpoint: str | Path, out: str | Path) -> dict:
    """Write ``checkpoint``'s backbone (float32 tensors, the output head included) and its
    hyperparameters (without ``init_from``) to ``out``, whole or not at all (a temporary file
    beside it, renamed: a full disk leaves a previous ``out`` as it was); returns what was
    written. One-line ``ValueError`` (a :class:`CheckpointError` for the checkpoint) before
    anything is written when ``out`` is the checkpoint (any spelling, a link), an existing file
    that is not a backbone written by this function (:func:`is_export`: another checkpoint of
    the run, a data file), a directory, or in a missing folder, or when ``checkpoint`` is no
    training checkpoint (missing, a directory, not a PyTorch archive, a file without a model's
    weights such as an exported backbone, or weights that hold NaN or inf, which no command
    loads)."""
    import torch

    from graphormer_urpe.prediction.load import check_finite
    from graphormer_urpe.cli.arguments import refuse_overwriting_inputs
    from graphormer_urpe.utils.files import atomic_write, check_writable_dir
    from graphormer_urpe.utils.torch_files import CheckpointError, read_checkpoint

    checkpoint, out = Path(checkpoint), Path(out)
    if out.is_dir():
        raise ValueError(f"out {out} is a directory; name the file to write")
    if not out.parent.is_dir():
        raise ValueError(f"out {out}: its folder {out.parent} does not exist")
    refuse_overwriting_inputs("out", [out], [("checkpoint", "training checkpoint", checkpoint)])
    check_writable_dir(out.parent, "out")
    if out.is_file():
        try:
            previous = read_checkpoint(out)
        except CheckpointError:
            previous = None
        if not is_export(previous):
            raise ValueError(f"out {out} exists and is not a backbone written by graphormer-urpe-export "
                             "(it would be overwritten): choose another output, or remove it first")
    saved = read_checkpoint(checkpoint)
    weights = saved.get("state_dict") if isinstance(saved, dict) else None
    if not isinstance(weights, dict) or not any(k.startswith("model.") for k in weights):
        raise CheckpointError(f"checkpoint {checkpoint} is not a training checkpoint: it has no model "
                              "weights (state_dict 'model.*'); an exported backbone is exported already")
    check_finite(checkpoint, weights)
    state = {k.removeprefix("model."): v.float().contiguous() if v.is_floating_point() else v
             for k, v in weights.items() if k.startswith("model.")}
    hparams = {k: v for k, v in (saved.get("hyper_parameters") or {}).items() if k != "init_from"}
    content = {"state_dict": state, "hyper_parameters": hparams,
               EXPORT_RECORD: {"global_step": int(saved.get("global_step", 0)), "source": checkpoint.name}}
    with atomic_write(out, binary=True) as handle:  # a full disk: one line from run_command
        torch.save(content, handle)
    return content


if __name__ == "__main__":
    sys.exit(main())
