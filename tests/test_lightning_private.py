"""Every private part of Lightning the package relies on (graphormer_urpe/utils/lightning_private.py)
exists in the installed Lightning, with the kind of value the package reads: an upgrade that
moves one fails here, by name."""
import lightning.pytorch as pl
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from graphormer_urpe.utils import lightning_private
from graphormer_urpe.training.run_checkpoint import RunCheckpoint


def test_the_trainer_internals_read_are_there():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         max_steps=1)
    assert isinstance(lightning_private.epoch_finished(trainer), bool)
    assert isinstance(lightning_private.logs_due(trainer), bool)
    assert lightning_private.limited_batches(trainer, 40) == 40
    limited = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         limit_train_batches=0.25)
    assert lightning_private.limited_batches(limited, 40) == 10
    tiny = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      limit_train_batches=0.01)
    with pytest.raises(MisconfigurationException, match="limit_train_batches"):  # Lightning's own message
        lightning_private.limited_batches(tiny, 10)
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    from graphormer_urpe.utils.files import is_local_path

    for path in ("runs/a/last.ckpt", "/abs/last.ckpt", "file:///abs/last.ckpt", "s3://b/c.ckpt", "memory://c.ckpt"):
        assert is_local_path(path) == _is_local_file_protocol(path)  # local exactly where Lightning reads locally
    assert is_local_path("runs/a/last.ckpt") and not is_local_path("s3://b/c.ckpt")
    module = pl.LightningModule()
    assert lightning_private.trainer_of(module) is None
    module.trainer = trainer
    assert lightning_private.trainer_of(module) is trainer


def test_the_model_checkpoint_members_run_checkpoint_uses_are_there():
    checkpoint = ModelCheckpoint(dirpath="unused", every_n_train_steps=3)
    for name in lightning_private.MODEL_CHECKPOINT_MEMBERS:
        assert hasattr(checkpoint, name), name
        assert hasattr(RunCheckpoint(), name), name
    assert checkpoint._every_n_train_steps == 3 and checkpoint._last_global_step_saved == 0
    for name in ("_save_checkpoint", "_save_last_checkpoint", "_monitor_candidates", "_should_save_on_train_epoch_end"):
        assert callable(getattr(checkpoint, name)), name


def test_the_lightning_cli_members_the_fit_overrides_are_there():
    from graphormer_urpe.training.lightning_cli import GraphormerCLI

    for name in lightning_private.LIGHTNING_CLI_MEMBERS:
        assert callable(getattr(LightningCLI, name, None)), name
        assert name in vars(GraphormerCLI), name  # overridden: the override is the reason it is listed


def test_the_launchers_process_observer_is_there_to_replace():
    from lightning.pytorch.strategies.launchers import subprocess_script

    assert "_launch_process_observer" in subprocess_script._SubprocessScriptLauncher.launch.__code__.co_names
    lightnings = subprocess_script._launch_process_observer
    try:
        lightning_private.replace_process_observer(print)
        assert subprocess_script._launch_process_observer is print
    finally:
        subprocess_script._launch_process_observer = lightnings


def test_the_strategy_launcher_and_checkpoint_names_read_are_there(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    spawned = pl.Trainer(accelerator="cpu", strategy=DDPStrategy(start_method="spawn"), logger=False)
    assert lightning_private.spawn_start_method(spawned.strategy) == "spawn"
    scripts = pl.Trainer(accelerator="cpu", strategy="ddp", devices=1, logger=False)
    assert lightning_private.spawn_start_method(scripts.strategy) is None
    trainer = pl.Trainer(accelerator="cpu", default_root_dir=tmp_path, logger=False)
    for version in (2, 10):
        (tmp_path / f"hpc_ckpt_{version}.ckpt").write_bytes(b"")
    assert lightning_private.checkpoint_to_open(trainer, "test", "hpc") == str(tmp_path / "hpc_ckpt_10.ckpt")
    assert lightning_private.checkpoint_to_open(trainer, "fit", None) is None
    assert lightning_private.checkpoint_to_open(trainer, "predict", "a.ckpt") == "a.ckpt"
