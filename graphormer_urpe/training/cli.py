"""``graphormer-urpe {fit,validate,test,predict}``: LightningCLI over the module and the datamodules.

Facts that belong to the data (vocabulary sizes, number of targets, ``max_hops``, the task and
the featurizer) are linked from the instantiated DataModule into the model, so a config names
each of them once. A run's outputs all go under ``trainer.default_root_dir``: TensorBoard and
CSV logs, and ``checkpoints/`` with the best model by validation metric plus ``last.ckpt``
(resume a killed run with ``--ckpt_path last``).
"""
from __future__ import annotations

import os

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from graphormer_urpe.training.module import GraphormerModule

#: DataModule attributes that the model takes as init arguments of the same name.
LINKED_DATA_FACTS = ("num_atom_embeddings", "num_bond_embeddings", "num_targets", "max_hops",
                     "task", "featurizer")
DEFAULT_RUN_DIR = "runs/default"


class GraphormerCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for name in LINKED_DATA_FACTS:
            parser.link_arguments(f"data.{name}", f"model.{name}", apply_on="instantiate")
        parser.link_arguments("data", "model.target_names", apply_on="instantiate",
                              compute_fn=lambda data: getattr(data, "target_columns", None))
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": "val/mae",
            "checkpoint.mode": "min",
            "checkpoint.save_last": True,
            "checkpoint.filename": "best-{step}-{val/mae:.4f}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        run_dir = config.trainer.default_root_dir or DEFAULT_RUN_DIR
        config.trainer.default_root_dir = run_dir
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = os.path.join(run_dir, "checkpoints")
        if config.trainer.logger in (None, True):
            config.trainer.logger = [
                Namespace(class_path=f"lightning.pytorch.loggers.{cls}",
                          init_args=Namespace(save_dir=run_dir, name=name))
                for cls, name in (("TensorBoardLogger", "tensorboard"), ("CSVLogger", "csv"))
            ]


def build_cli(args: list[str] | None = None, run: bool = True) -> GraphormerCLI:
    return GraphormerCLI(
        GraphormerModule,
        pl.LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    build_cli(args)


if __name__ == "__main__":
    main()
