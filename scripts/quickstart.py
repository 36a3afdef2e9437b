"""The Quick start's main job: train a small Graphormer + URPE on the real ZINC-12k for a short CPU
budget (configs/zinc.yaml + configs/quickstart.yaml: 2 layers x 64, 7,500 steps capped at 7
minutes), then report which model it trained, and the validation and test MAE of the best
checkpoint and where it is. It trains on one CPU thread unless ``OMP_NUM_THREADS`` is set.

    python scripts/quickstart.py [extra LightningCLI arguments, e.g. --trainer.max_time 00:00:02:00]

A run directory never holds two runs: where ``runs/zinc_quickstart`` already holds a model, the
run goes to ``runs/zinc_quickstart-2`` (then ``-3``, ...) unless ``--trainer.default_root_dir``
is given.

ZINC is built from the local data copies when they hold it (``$GRAPHORMER_URPE_DATA``/zinc, or
``../shared/data/zinc`` beside the checkout), else downloaded by PyG.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def describe(model) -> str:
    """The trained model in words, from the resolved backbone its checkpoint records."""
    backbone = model.hparams.backbone
    return (f"Graphormer + {backbone['attention'].upper()}, {backbone['num_layers']} layers x "
            f"{backbone['hidden_dim']} dim, {backbone['num_heads']} heads")


def run_dir_arguments(argv: list[str]) -> list[str]:
    """``--trainer.default_root_dir`` for a run that would land in a run directory holding an
    earlier run's checkpoints: the first free ``<dir>-N``; none if the caller chose one."""
    import yaml

    from graphormer_urpe.training.run_checkpoint import checkpoints_in

    if any(arg.startswith("--trainer.default_root_dir") for arg in argv):
        return []
    default = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["trainer"]["default_root_dir"]
    run_dir, n = default, 1
    while checkpoints_in(Path(run_dir) / "checkpoints"):
        n += 1
        run_dir = f"{default}-{n}"
    return [] if run_dir == default else ["--trainer.default_root_dir", run_dir]


def main(argv: list[str]) -> None:
    os.chdir(REPO)

    import torch

    from graphormer_urpe.training.lightning_cli import build_cli

    # One thread unless OMP_NUM_THREADS says otherwise: on a 2-core CPU shared with other jobs,
    # two threads trained this small model 7-12x slower than one (their barriers wait for a busy
    # core): 0.5-0.9 vs 6.4-8.8 steps/s, measured 2026-11-23.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    started = time.perf_counter()
    sys.argv = sys.argv[:1]  # the arguments travel as `args`; LightningCLI must not read them twice
    cli = build_cli(["--config", "configs/zinc.yaml", "--config", "configs/quickstart.yaml",
                     *run_dir_arguments(argv), *argv], run=False)
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    trainer.fit(model, datamodule=data)
    best = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    val = trainer.validate(model, datamodule=data, ckpt_path=best, verbose=False)[0]
    test = trainer.test(model, datamodule=data, ckpt_path=best, verbose=False)[0]
    minutes = (time.perf_counter() - started) / 60
    print(f"\n=== {describe(model)} on ZINC-12k (quick-start budget) ===")
    print(f"parameters        {sum(p.numel() for p in model.parameters()):,}")
    print(f"optimizer steps   {trainer.global_step}")
    print(f"validation MAE    {val['val/mae']:.4f}")
    print(f"test MAE          {test['test/mae']:.4f}")
    print(f"best checkpoint   {best}")
    print(f"last checkpoint   {Path(trainer.checkpoint_callback.dirpath) / 'last.ckpt'}")
    print(f"wall time         {minutes:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1:])
