"""Several runs as one stacked model (``training/ensemble.py``) on the real ZINC-12k, tiny models:
a member trains as its solo ``graphormer-urpe fit`` does, an rpe member keeps C at exactly 1,
URPE with C frozen is RPE bit for bit, the members' checkpoints are ordinary ones, and a stopped
ensemble resumes exactly."""
from __future__ import annotations

import csv
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.cli import build_cli
from graphormer_urpe.training.ensemble import (METRICS_FILE, STATE_FILE, Ensemble, EnsembleStopped, MemberSpec,
                                               check_members)
from test_capture import CaptureGuard  # what a CUDA graph cannot hold

REPO = Path(__file__).resolve().parents[2]
TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
#: Training graphs of at most this many nodes: 41 of ZINC-12k's 10,000, so an epoch is 3 batches
#: of 16 and its last one holds 9 graphs (the ensemble pads it with empty ones).
MAX_NODES = 11
STEPS = 6


def member_args(run_dir: Path, data_root: Path, arm: str, seed: int, backbone: dict,
                *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "zinc.yaml"),
        "--model.backbone", json.dumps({**backbone, "attention": arm}),
        "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.precision", "32-true", "--trainer.max_steps", str(STEPS),
        "--trainer.max_epochs", "-1", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "3",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", "1", "--trainer.gradient_clip_val", "0.05",
        "--model.warmup_steps", "2", "--model.total_steps", str(STEPS),
        "--data.init_args.root", str(data_root), "--data.init_args.batch_size", "16",
        "--data.init_args.max_nodes", str(MAX_NODES), *extra,
    ]


def specs(tmp_path: Path, data_root: Path, backbone: dict, name: str = "ens") -> list[MemberSpec]:
    """An urpe member with seed 0 and an rpe member with seed 1 (own data orders)."""
    return [MemberSpec(f"{arm}-s{seed}", tuple(member_args(tmp_path / name / f"{arm}-s{seed}",
                                                           data_root, arm, seed, backbone)))
            for arm, seed in (("urpe", 0), ("rpe", 1))]


def logged(metrics_csv: Path, column: str) -> list[float]:
    with open(metrics_csv, newline="") as handle:
        return [float(row[column]) for row in csv.DictReader(handle) if row.get(column)]


def test_members_train_as_their_solo_runs(zinc_data_root, tmp_path, one_torch_thread):
    members = specs(tmp_path, zinc_data_root, {**TINY, **NO_DROPOUT})
    ensemble = Ensemble(members, tmp_path / "ens" / "state")
    assert ensemble.batches_per_epoch == 3  # the last batch of an epoch is partial
    ensemble.fit()
    assert ensemble.step == STEPS

    for index, spec in enumerate(members):
        solo_dir = tmp_path / "solo" / spec.label
        args = list(spec.cli_args)
        args[args.index("--trainer.default_root_dir") + 1] = str(solo_dir)
        cli = build_cli(["fit", *args])
        assert cli.trainer.global_step == STEPS
        solo = torch.load(solo_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        run_dir = tmp_path / "ens" / spec.label
        mine = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert mine["global_step"] == STEPS
        assert mine["hyper_parameters"] == solo["hyper_parameters"]
        assert set(mine["state_dict"]) == set(solo["state_dict"])
        moved = 0
        for name, value in cli.model.state_dict().items():  # the solo weights after STEPS
            torch.testing.assert_close(mine["state_dict"][name], value, rtol=1e-5, atol=5e-7,
                                       msg=lambda m: f"{spec.label} {name}: {m}")
            moved += not torch.equal(value, ensemble.members[index].module.state_dict()[name])
        assert moved > 10, "training moved the weights"
        solo_losses = logged(next((solo_dir / "csv").rglob("metrics.csv")), "train/loss")
        my_losses = logged(run_dir / "csv" / "ensemble" / "metrics.csv", "train/loss")
        assert len(my_losses) == len(solo_losses) == STEPS
        torch.testing.assert_close(torch.tensor(my_losses), torch.tensor(solo_losses),
                                   rtol=1e-5, atol=1e-6)
        # Validation and best-checkpoint selection as the solo run: same file name, same score.
        solo_best = Path(solo["callbacks"][next(iter(solo["callbacks"]))]["best_model_path"]).name
        best_state = mine["callbacks"][next(k for k in mine["callbacks"] if k.startswith("ModelCheckpoint"))]
        assert Path(best_state["best_model_path"]).name == solo_best
        assert Path(best_state["best_model_path"]).exists()

    # The rpe member: stacked with C, which stays exactly 1; its checkpoint is a plain rpe model.
    deltas = [p for name, p in ensemble.params.items() if name.endswith(".delta")]
    assert all(torch.equal(d[1], torch.zeros_like(d[1])) for d in deltas)
    assert any(not torch.equal(d[0], torch.zeros_like(d[0])) for d in deltas), "urpe's C learns"
    rpe = torch.load(tmp_path / "ens" / "rpe-s1" / "checkpoints" / "last.ckpt", weights_only=False)
    assert rpe["hyper_parameters"]["backbone"]["attention"] == "rpe"
    assert not any("urpe_scales" in key for key in rpe["state_dict"])

    # The best checkpoints load in `graphormer-urpe test` and give the metric the ensemble
    # measures itself; `graphormer-urpe-predict` reads them too. The first member goes through
    # the installed commands, the second through their main() in this process.
    from graphormer_urpe.predict import main as predict_main
    from graphormer_urpe.training.cli import main as cli_main

    test_loader = ensemble.members[0].datamodule.test_dataloader()
    direct = ensemble.evaluate(test_loader, 3)
    bin_dir = Path(sys.executable).parent
    smiles = tmp_path / "in.smi"
    smiles.write_text("CCO\nc1ccccc1O\n")
    for index, spec in enumerate(members):
        run_dir = tmp_path / "ens" / spec.label
        best = next(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("epoch="))
        # the best checkpoint holds the weights of its step, not the last ones
        assert torch.load(best, weights_only=False)["global_step"] <= STEPS
        logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                             "init_args": {"save_dir": str(run_dir), "name": "test"}})
        last = run_dir / "checkpoints" / "last.ckpt"
        test_args = ["test", *spec.cli_args, "--trainer.logger", logger, "--ckpt_path", str(last)]
        predict_args = ["--ckpt", str(last), "--input", str(smiles), "--output", str(tmp_path / f"p{index}.csv"),
                        "--workers", "0", "--quiet"]
        if index == 0:
            done = subprocess.run([str(bin_dir / "graphormer-urpe"), *test_args], cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            predicted = subprocess.run([str(bin_dir / "graphormer-urpe-predict"), *predict_args],
                                       capture_output=True, text=True, timeout=300)
            assert predicted.returncode == 0, predicted.stderr[-3000:]
        else:
            assert cli_main(test_args) == 0
            assert predict_main(predict_args) == 0
        test_mae = logged(next((run_dir / "test").rglob("metrics.csv")), "test/mae")[-1]
        assert test_mae == pytest.approx(float(direct[index]), rel=1e-5), spec.label
        assert len((tmp_path / f"p{index}.csv").read_text().splitlines()) == 3


def test_urpe_with_frozen_c_is_rpe_bit_for_bit(zinc_data_root, one_torch_thread):
    """Five steps of the solo training step, dropout on: URPE whose C is frozen at 1 and plain
    RPE give identical losses and weights (so an rpe member may be stacked as URPE)."""
    from graphormer_urpe.data import ZINCDataModule
    from graphormer_urpe.training.module import GraphormerModule
    from graphormer_urpe.training.optim import parameter_groups
    from graphormer_urpe.training.schedule import warmup_polynomial_decay

    data = ZINCDataModule(root=str(zinc_data_root), batch_size=32)
    data.setup("fit")
    batches = [batch for _, batch in zip(range(5), data.train_dataloader())]

    def train(attention: str):
        torch.manual_seed(3)
        module = GraphormerModule(DataFacts(29, 5), backbone={**TINY, "attention": attention})
        if attention == "urpe":
            for scale in module.model.urpe_scales:
                scale.delta.requires_grad_(False)
        start = {k: v.clone() for k, v in module.state_dict().items()}
        optimizer = torch.optim.AdamW(parameter_groups(module, 0.01), lr=1e-3, weight_decay=0.01)
        scheduler = warmup_polynomial_decay(optimizer, 2, 10, 1e-9)
        losses = []
        for batch in batches:
            loss = module._loss(module(batch), batch.y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
        return start, module.state_dict(), torch.stack(losses)

    urpe_start, urpe, urpe_losses = train("urpe")
    rpe_start, rpe, rpe_losses = train("rpe")
    assert set(urpe) - set(rpe) == {"model.urpe_scales.0.delta", "model.urpe_scales.1.delta"}
    assert all(torch.equal(urpe_start[k], rpe_start[k]) for k in rpe)  # the same initialisation
    assert torch.equal(urpe_losses, rpe_losses)
    for name, value in rpe.items():
        assert torch.equal(urpe[name], value), name
        assert "graph_token" not in name or not torch.equal(value, rpe_start[name]), "trained"


def test_a_stopped_ensemble_resumes_exactly(zinc_data_root, tmp_path, one_torch_thread):
    """Dropout on: stopped after an epoch and continued by a new Ensemble (as after a kill),
    the members end bit for bit where an uninterrupted ensemble does."""
    backbone = {**TINY, "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}
    straight = Ensemble(specs(tmp_path, zinc_data_root, backbone, "straight"), tmp_path / "s")
    straight.fit()
    first = Ensemble(specs(tmp_path, zinc_data_root, backbone, "resumed"), tmp_path / "r")
    first.fit(stop_at_step=1)  # the chunk ends with the first epoch (3 steps)
    assert first.step == 3 and (tmp_path / "r" / STATE_FILE).exists()
    for member in ("urpe-s0", "rpe-s1"):  # a row logged after the save, then killed
        with open(tmp_path / "resumed" / member / METRICS_FILE, "a", newline="") as handle:
            handle.write("1,3,9.9,\r\n")
    resumed = Ensemble(specs(tmp_path, zinc_data_root, backbone, "resumed"), tmp_path / "r")
    assert resumed.step == 3
    resumed.fit(stop_at_step=3)  # a chunk ends at the first epoch end after a step: here, the budget's
    assert resumed.step == straight.step == STEPS
    for name, value in straight.params.items():
        assert torch.equal(resumed.params[name], value), name
    for member in ("urpe-s0", "rpe-s1"):
        a = torch.load(tmp_path / "straight" / member / "checkpoints" / "last.ckpt", weights_only=False)
        b = torch.load(tmp_path / "resumed" / member / "checkpoints" / "last.ckpt", weights_only=False)
        assert all(torch.equal(a["state_dict"][k], v) for k, v in b["state_dict"].items())
        state = lambda c: c["callbacks"][next(iter(c["callbacks"]))]  # noqa: E731
        assert Path(state(a)["best_model_path"]).name == Path(state(b)["best_model_path"]).name
        for column in ("train/loss", "val/mae"):  # each step logged once, as without the stop
            assert (logged(tmp_path / "resumed" / member / METRICS_FILE, column)
                    == logged(tmp_path / "straight" / member / METRICS_FILE, column))
    # Another set of runs refuses the state.
    with pytest.raises(ValueError, match="belongs to other runs"):
        Ensemble(specs(tmp_path, zinc_data_root, backbone, "other"), tmp_path / "r")


def test_device_resident_batches_train_as_the_collated_ones(zinc_data_root, tmp_path, one_torch_thread):
    """The GPU's data path (batches gathered from a device copy of the split), run on the CPU."""
    backbone = {**TINY, **NO_DROPOUT}
    collated = Ensemble(specs(tmp_path, zinc_data_root, backbone, "collated"), tmp_path / "c")
    resident = Ensemble(specs(tmp_path, zinc_data_root, backbone, "resident"), tmp_path / "r",
                        resident=True)
    assert collated.resident is None and resident.resident is not None
    collated.fit()
    resident.fit()
    for name, value in collated.params.items():
        assert torch.equal(resident.params[name], value), name


@pytest.mark.parametrize("extra, message", [
    (("--model.lr", "0.001"), "differs from urpe-s0 in more than the seed and the arm"),
    (("--trainer.accumulate_grad_batches", "2"), "accumulate_grad_batches"),
    (("--model.head_lr", "0.001"), "trains from scratch, without model.head_lr"),
])
def test_an_ensemble_refuses_what_it_cannot_train_as_solo_runs(zinc_data_root, tmp_path, extra, message):
    first, second = specs(tmp_path, zinc_data_root, TINY)
    changed = MemberSpec(second.label, (*second.cli_args, *extra))
    members = [first, changed] if extra[0].startswith("--model") else [changed, changed]
    with pytest.raises(ValueError, match=message):
        Ensemble(members, tmp_path / "state")


@pytest.mark.parametrize("log_every, skipped", [(1, 1), (50, 3)])
def test_a_diverged_member_stops_the_ensemble_and_is_named(zinc_data_root, tmp_path, one_torch_thread,
                                                           log_every, skipped):
    """The training engine's policy: a step with a non-finite loss or gradient is skipped on the
    device (no parameter or moment moves), and an interval of only skipped steps stops the run
    naming the member, before anything is saved: at the interval's report (every step here), or
    at the validation that ends the first epoch (3 steps) before the first report."""
    members = [MemberSpec(spec.label, (*spec.cli_args, "--trainer.log_every_n_steps", str(log_every)))
               for spec in specs(tmp_path, zinc_data_root, {**TINY, **NO_DROPOUT})]
    ensemble = Ensemble(members, tmp_path / "state")
    with torch.no_grad():
        ensemble.params["head.weight"][1] = float("nan")
    before = {name: p.detach().clone() for name, p in ensemble.params.items()}
    with pytest.raises(FloatingPointError, match=rf"every training step of the last {skipped} had a non-finite "
                                                 rf"loss or gradient in \['rpe-s1'\] \(up to step {skipped}\)"):
        ensemble.fit()
    for name, value in ensemble.params.items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, equal_nan=True, msg=name)
    assert not (tmp_path / "state" / STATE_FILE).exists()
    assert not any((tmp_path / "ens" / label / "checkpoints").exists() for label in ("urpe-s0", "rpe-s1"))


def train_steps(ensemble: Ensemble, count: int, sync_debug: bool = False) -> torch.Tensor:
    """``count`` steps of ``ensemble``'s stacked step over its epochs, outside Lightning's loop (at
    the schedule's first rate); ``sync_debug``: any host sync inside a replayed step (batch
    gathering included) raises (capturing itself synchronizes once)."""
    module, batches = ensemble.module, ensemble.batches
    module.build_optimizer()
    losses, epoch = [], 0
    while len(losses) < count:
        batches.set_epoch(epoch)
        for index in range(min(len(batches), count - len(losses))):
            replay = sync_debug and module._graph is not None
            if sync_debug:
                torch.cuda.set_sync_debug_mode("error" if replay else "default")
            try:
                losses.append(module.train_step(batches[index]))
            finally:
                if sync_debug:
                    torch.cuda.set_sync_debug_mode("default")
        epoch += 1
    return torch.stack(losses)


@pytest.mark.gpu
@pytest.mark.parametrize("in_turn, attention_impl", [(False, "eager"), (True, "eager"), (True, "triton")],
                         ids=["vmap", "in turn", "in turn, fused attention"])
def test_the_captured_step_equals_the_eager_one_without_host_syncs(zinc_data_root, tmp_path, in_turn,
                                                                  attention_impl):
    backbone = {**TINY, **NO_DROPOUT}
    eager = Ensemble(specs(tmp_path, zinc_data_root, backbone, "eager"), tmp_path / "e")
    graphed = Ensemble(specs(tmp_path, zinc_data_root, backbone, "graphed"), tmp_path / "g",
                       cuda_graph=True, in_turn=in_turn, attention_impl=attention_impl)
    assert eager.device.type == "cuda" and graphed.module.cuda_graph
    expected = train_steps(eager, 20)
    losses = train_steps(graphed, 20, sync_debug=True)
    assert graphed.module._graph is not None
    # The fused kernels sum in another order than the eager core; AdamW turns a rounding
    # difference in a gradient near 0 into a step of up to +-lr (2e-4) the other way.
    close = {"rtol": 1e-5, "atol": 1e-6} if attention_impl == "eager" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(losses, expected, **close)
    for name, value in eager.params.items():
        torch.testing.assert_close(graphed.params[name], value,
                                   **(close if attention_impl == "eager" else {"rtol": 0, "atol": 5e-4}))




class Interrupt(pl.Callback):
    """Sends this process SIGINT at the end of the given steps."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step in self.steps:
            os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_stops_the_ensemble_at_the_epoch_end_with_its_state(zinc_data_root, tmp_path, one_torch_thread):
    """SIGINT (Ctrl-C) during step 2 is held to the end of the epoch (step 3): the state is
    saved there, the fit stops with EnsembleStopped and gives the handlers back, and the same
    members resume from it to where an uninterrupted ensemble ends."""

    backbone = {**TINY, **NO_DROPOUT}
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    straight = Ensemble(specs(tmp_path, zinc_data_root, backbone, "straight"), tmp_path / "s")
    straight.fit()
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers  # given back
    stopped = Ensemble(specs(tmp_path, zinc_data_root, backbone, "stopped"), tmp_path / "t")
    lines: list[str] = []
    stopped.progress = stopped.module.progress = lines.append
    with pytest.raises(EnsembleStopped, match=r"stopped by SIGINT at the end of an epoch \(step 3\)"):
        stopped.fit(callbacks=[Interrupt({1})])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "ensemble: SIGINT: stopped at the end of epoch 0 (step 3), its state saved" in lines
    assert torch.load(tmp_path / "t" / STATE_FILE, weights_only=True)["global_step"] == 3
    resumed = Ensemble(specs(tmp_path, zinc_data_root, backbone, "stopped"), tmp_path / "t")
    assert resumed.step == 3
    resumed.fit()
    assert resumed.step == STEPS
    for name, value in straight.params.items():
        assert torch.equal(resumed.params[name], value), name


@pytest.mark.parametrize("steps, how, message", [
    ({1, 2}, "at once", r"stopped at once by SIGINT \(at step 2\); the same command resumes from the state saved last"),
    ({4}, "finished", r"SIGINT came in the last epoch: training finished \(step 6\) and is saved"),
])
def test_a_second_signal_stops_at_once_and_one_in_the_last_epoch_lets_it_finish(
        zinc_data_root, tmp_path, one_torch_thread, steps, how, message):

    ensemble = Ensemble(specs(tmp_path, zinc_data_root, {**TINY, **NO_DROPOUT}), tmp_path / "state")
    with pytest.raises(EnsembleStopped, match=message) as stopped:
        ensemble.fit(callbacks=[Interrupt(steps)])
    assert stopped.value.how == how
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    state = tmp_path / "state" / STATE_FILE
    last = tmp_path / "ens" / "urpe-s0" / "checkpoints" / "last.ckpt"
    if how == "at once":  # before the first epoch's end: nothing saved
        assert not state.exists() and not last.exists()
    else:
        assert torch.load(state, weights_only=True)["global_step"] == STEPS
        assert torch.load(last, weights_only=True)["global_step"] == STEPS


@pytest.mark.slow
def test_a_compiled_ensemble_trains_as_the_eager_one(zinc_data_root, tmp_path, one_torch_thread, monkeypatch):
    """``--model.compile true`` for every member: the stacked step (the vmapped forward of all
    members and its backward) is traced whole into one graph without a break, and trains as the
    uncompiled one. Compiled by ``aot_eager`` (dynamo and AOTAutograd as on a GPU, without
    inductor's code generation: on a 2-core CPU its C++ compiles take ~50 s for one layer)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    backbone = {**TINY, **NO_DROPOUT}
    eager = Ensemble(specs(tmp_path, zinc_data_root, backbone, "eager"), tmp_path / "e")
    compiled = Ensemble([MemberSpec(spec.label, (*spec.cli_args, "--model.compile", "true"))
                         for spec in specs(tmp_path, zinc_data_root, backbone, "compiled")], tmp_path / "c")
    assert not hasattr(eager.module._train_step, "_torchdynamo_orig_callable")
    assert hasattr(compiled.module._train_step, "_torchdynamo_orig_callable")
    expected = train_steps(eager, 4)
    counters.clear()
    losses = train_steps(compiled, 4)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for name, value in eager.params.items():
        torch.testing.assert_close(compiled.params[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_members_in_turn_train_as_the_stacked_step(zinc_data_root, tmp_path, one_torch_thread, monkeypatch,
                                                    compile):
    """``in_turn``: the members' forward and backward one after another on their slices of the
    stacked parameters trains as the vmapped step does (no dropout: the same arithmetic, other
    random streams); compiled, one graph serves every member (``aot_eager``, as above)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    backbone = {**TINY, **NO_DROPOUT}
    extra = ("--model.compile", "true") if compile else ()
    stacked = Ensemble(specs(tmp_path, zinc_data_root, backbone, "stacked"), tmp_path / "s")
    in_turn = Ensemble([MemberSpec(spec.label, (*spec.cli_args, *extra))
                        for spec in specs(tmp_path, zinc_data_root, backbone, "in_turn")], tmp_path / "t",
                       in_turn=True)
    module = in_turn.module
    assert module._train_step == module._members_in_turn
    assert hasattr(module._member_step, "_torchdynamo_orig_callable") == compile
    expected = train_steps(stacked, 4)
    counters.clear()
    losses = train_steps(in_turn, 4)
    if compile:
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for name, value in stacked.params.items():
        torch.testing.assert_close(in_turn.params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(torch.equal(d[1], torch.zeros_like(d[1]))  # the rpe member's C stays exactly 1
               for name, d in in_turn.params.items() if name.endswith(".delta"))
    if not compile:  # and the step stays one a CUDA graph can hold: no host read, no data-dependent shape
        guard = CaptureGuard()
        with guard:
            module._step_body(in_turn.batches[0])
        assert guard.ops > 500 and guard.refused == []


@pytest.mark.slow
def test_fused_attention_members_in_turn_under_the_cpu_interpreter(under_triton_interpreter):
    """The next test, where Triton's interpreter runs the fused kernels on a CPU."""
    under_triton_interpreter(__file__, "test_members_in_turn_train_on_the_fused_attention_kernels", passed=4)


@pytest.mark.parametrize("compile, precision",
                         [(False, "32-true"), (True, "32-true"), (False, "bf16-mixed"), (True, "bf16-mixed")],
                         ids=["eager", "compiled", "bf16-mixed", "compiled bf16-mixed"])
def test_members_in_turn_train_on_the_fused_attention_kernels(zinc_data_root, tmp_path, one_torch_thread,
                                                              monkeypatch, fused_kernel_calls, compile, precision):
    """``attention_impl="triton"`` with the members in turn: every member's attention forward and
    backward run on the fused kernels (counted), the members train as with the eager core (no
    dropout: the same arithmetic up to float32 rounding), the rpe member's C stays exactly 1, and
    validation predicts in turn too. Compiled (``aot_eager``), the kernels run between the
    traced pieces, which the first step compiles and the next steps reuse. At the recipe's
    bf16-mixed the kernels take bf16 q, k, v (the eager core computes on them in float32, the
    kernels keep ~16 bits of ``P ⊙ C`` in two bf16 parts), so the runs agree to ~1e-3."""
    from torch._dynamo.utils import counters

    calls = fused_kernel_calls
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    backbone = {**TINY, **NO_DROPOUT}
    extra = ("--trainer.precision", precision, *(("--model.compile", "true") if compile else ()))
    ensembles = [Ensemble([MemberSpec(spec.label, (*spec.cli_args, *extra))
                           for spec in specs(tmp_path, zinc_data_root, backbone, impl)], tmp_path / impl,
                          in_turn=True, attention_impl=impl)
                 for impl in ("eager", "triton")]
    expected = train_steps(ensembles[0], 3)
    assert calls == []
    counters.clear()
    graphs, body = [], ensembles[1].module._step_body
    monkeypatch.setattr(ensembles[1].module, "_step_body",
                        lambda batch: (body(batch), graphs.append(counters["stats"]["unique_graphs"]))[0])
    losses = train_steps(ensembles[1], 3)
    assert len(calls) == 3 * 2 * TINY["num_layers"]  # steps x members x layers
    # compiled: the pieces between the kernels are traced in the first step, then reused
    assert graphs == ([graphs[0]] * 3 if compile else [0] * 3) and (graphs[0] > 0) == compile
    close = {"rtol": 1e-4, "atol": 1e-5} if precision == "32-true" else {"rtol": 1e-3, "atol": 1e-4}
    # AdamW's first updates are about +-lr wherever a gradient is near 0, so bf16's rounding can
    # move such a weight by up to 2 lr (lr 2e-4 here) per step
    param_close = close if precision == "32-true" else {"rtol": 0, "atol": 2 * 3 * 2e-4}
    torch.testing.assert_close(losses, expected, **close)
    for name, value in ensembles[0].params.items():
        torch.testing.assert_close(ensembles[1].params[name], value, **param_close, msg=name)
    assert all(torch.equal(d[1], torch.zeros_like(d[1]))
               for name, d in ensembles[1].params.items() if name.endswith(".delta"))
    maes = [ensemble.module.evaluate(ensemble.val_loader, 1) for ensemble in ensembles]
    assert len(calls) > 3 * 2 * TINY["num_layers"]  # validation ran the kernels, member by member
    torch.testing.assert_close(maes[1], maes[0], **close)


def test_fused_attention_needs_the_members_in_turn(zinc_data_root, tmp_path):
    """vmap cannot batch the fused kernels: ``attention_impl="triton"`` without ``in_turn`` is
    refused in one line before anything is built, as is a core an ensemble does not run."""
    members = specs(tmp_path, zinc_data_root, TINY)
    with pytest.raises(ValueError, match="needs the members in turn"):
        Ensemble(members, tmp_path / "state", attention_impl="triton")
    with pytest.raises(ValueError, match="attention_impl is one of eager, triton; got 'sdpa'"):
        Ensemble(members, tmp_path / "state", in_turn=True, attention_impl="sdpa")
    assert not (tmp_path / "state").exists()


def test_a_saved_state_resumes_with_or_without_compile():
    """``--model.compile`` says how the step runs, not what is trained: a state saved by members
    without it resumes with it (and the reverse); any other difference is refused."""
    saved = [["--config", "configs/zinc.yaml", "--seed_everything", "0"],
             ["--config", "configs/zinc.yaml", "--seed_everything", "1"]]
    check_members(saved, [[*args, "--model.compile", "true"] for args in saved], "state")
    check_members([[*args, "--model.compile=false"] for args in saved], saved, "state")
    with pytest.raises(ValueError, match="state belongs to other runs"):
        check_members(saved, [[*args, "--model.lr", "0.001"] for args in saved], "state")
    with pytest.raises(ValueError, match="state belongs to other runs"):
        check_members(saved[:1], saved, "state")
