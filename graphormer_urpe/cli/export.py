"""``graphormer-urpe-export CHECKPOINT OUT``: a training checkpoint's backbone as a weights-only
file (:func:`graphormer_urpe.prediction.pretrained.export`), for ``--model.init_from``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphormer_urpe.prediction.pretrained import export
from graphormer_urpe.utils.process import run_command

PROG = "graphormer-urpe-export"


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


if __name__ == "__main__":
    sys.exit(main())
