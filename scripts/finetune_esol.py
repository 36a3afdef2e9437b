"""Does starting from a ZINC-trained backbone help on ESOL? Pretrain, fine-tune, compare, paired by seed.

1. Pretrain Graphormer + URPE (the Quick start's 2 x 64, ``configs/quickstart.yaml``) on ZINC-full
   (220,011 training molecules, penalised logP) for a CPU budget: ``--pretrain-steps`` optimizer
   steps capped at ``--pretrain-minutes`` (one thread).
2. On ESOL (``configs/esol.yaml`` + ``configs/esol_finetune.yaml``: ZINC featurizer, 2 x 64, 50
   epochs, lr 1e-3, warmup 6%), for each split (random, scaffold) and seed: train the same model
   from scratch and from the pretrained backbone (``--model.init_from``, a fresh head, the backbone
   frozen for the first 29 steps). Same budget, same data order, the checkpoint chosen by
   validation MAE only; its test RMSE is measured once at the end.
3. Write the table (mean ± std of test RMSE per arm, per-seed paired differences) to
   ``<work>/finetune_esol.md`` and print it with a final JSON line.

    python scripts/finetune_esol.py [--work runs/finetune_esol] [--seeds 0 1 2 3 4]

Runs train one after another on one torch thread; a run whose result exists is not repeated,
so ``--splits random`` and ``--splits scaffold`` in two processes share the work (the pretraining
must exist first: ``--pretrain-only``), and a last invocation without ``--splits`` writes the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
ESOL_CONFIGS = ["--config", "configs/esol.yaml", "--config", "configs/esol_finetune.yaml"]
SPLITS = ("random", "scaffold")


def cli(args: list[str], log: Path) -> None:
    """``graphormer-urpe`` in a subprocess (one torch thread), its output in ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "GRAPHORMER_URPE_ZINC_SOURCE": os.environ.get("GRAPHORMER_URPE_ZINC_SOURCE", str(SHARED / "zinc"))}
    command = [sys.executable, "-m", "graphormer_urpe.cli.fit", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(args)}; see {log}")


def pretrain(work: Path, steps: int, minutes: int) -> Path:
    run = work / "pretrain_zinc_full"
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        print(f"pretraining on ZINC-full: {steps} steps, at most {minutes} min -> {run}", flush=True)
        cli(["fit", "--config", "configs/zinc.yaml", "--config", "configs/zinc_full.yaml",
             "--config", "configs/quickstart.yaml", "--trainer.default_root_dir", str(run),
             "--trainer.max_steps", str(steps), "--model.warmup_steps", str(steps // 20),
             "--trainer.max_time", f"00:00:{minutes:02d}:00",
             "--checkpoint.overwrite", "true"], run / "fit.log")  # a killed start left no last.ckpt
    return ckpt


def test_rmse(ckpt: Path, split: str, seed: int) -> float:
    """Test RMSE of ``ckpt`` on ESOL's ``split`` test rows (the DataModule of the run)."""
    import numpy as np
    import torch

    from graphormer_urpe.data import CSVDataModule
    from graphormer_urpe.prediction.load import load_module

    module = load_module(ckpt)
    data = CSVDataModule(path=str(SHARED / "moleculenet" / "esol.csv"),
                         target_columns=["measured log solubility in mols per litre"], split=split,
                         split_seed=seed, featurizer="zinc", encode_threads=1, build_workers=1)
    data.setup("test")
    errors = []
    with torch.inference_mode():
        for batch in data.test_dataloader():
            errors.append((module(batch).float() - batch.y).numpy().ravel())
    return float(np.sqrt(np.mean(np.concatenate(errors) ** 2)))


def checkpoint_state(ckpt: Path) -> tuple[int, dict]:
    """A run's ``last.ckpt``: its optimizer steps and its ``ModelCheckpoint`` state (the best
    checkpoint's ``best_model_path`` and ``best_model_score``)."""
    from graphormer_urpe.prediction.load import model_checkpoint_state
    from graphormer_urpe.utils.torch_files import read_checkpoint

    last = read_checkpoint(ckpt)
    return int(last["global_step"]), model_checkpoint_state(last)


def checkpoint_record(ckpt: Path) -> tuple[int, float]:
    """``(optimizer steps, best validation score)`` recorded in a run's ``last.ckpt``."""
    steps, state = checkpoint_state(ckpt)
    return steps, float(state["best_model_score"])


def arm(work: Path, split: str, seed: int, init_from: Path | None) -> dict:
    name = f"{split}/{'finetune' if init_from else 'scratch'}/seed{seed}"
    run = work / name
    result_file = run / "result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    if run.exists():  # an unfinished run: start it again
        import shutil
        shutil.rmtree(run)
    extra = ["--model.init_from", str(init_from)] if init_from else ["--model.freeze_backbone_steps", "0"]
    started = time.perf_counter()
    cli(["fit", *ESOL_CONFIGS, "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
         "--data.init_args.split_seed", str(seed), "--data.init_args.split", split, "--data.init_args.encode_threads", "1",
         "--data.init_args.build_workers", "1", "--trainer.default_root_dir", str(run),
         "--trainer.enable_progress_bar", "false", *extra], run / "fit.log")
    _, state = checkpoint_state(run / "checkpoints" / "last.ckpt")
    best = Path(state["best_model_path"])
    result = {"split": split, "seed": seed, "arm": "finetune" if init_from else "scratch",
              "best": best.name, "val_mae": float(state["best_model_score"]),
              "test_rmse": test_rmse(best, split, seed), "minutes": (time.perf_counter() - started) / 60}
    result_file.write_text(json.dumps(result))
    print(f"{name}: val MAE {result['val_mae']:.4f}, test RMSE {result['test_rmse']:.4f} "
          f"({result['minutes']:.1f} min)", flush=True)
    return result


def mean_std(values: list[float]) -> str:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f}"


def table(results: list[dict], seeds: list[int]) -> tuple[str, dict]:
    lines = ["| split | from scratch | fine-tuned | fine-tuned - scratch, per seed " +
             f"({', '.join(map(str, seeds))}) | fine-tuned better |",
             "| --- | ---: | ---: | --- | ---: |"]
    summary = {}
    for split in SPLITS:
        by = {(r["arm"], r["seed"]): r["test_rmse"] for r in results if r["split"] == split}
        scratch = [by[("scratch", s)] for s in seeds]
        tuned = [by[("finetune", s)] for s in seeds]
        diffs = [t - s for t, s in zip(tuned, scratch)]
        wins = sum(d < 0 for d in diffs)
        lines.append(f"| {split} | {mean_std(scratch)} | {mean_std(tuned)} | "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)} (mean {sum(diffs) / len(diffs):+.3f}) | "
                     f"{wins} of {len(seeds)} |")
        summary[split] = {"scratch": scratch, "finetune": tuned, "wins": wins}
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "finetune_esol")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS,
                        help="train these splits' runs (two invocations can share the work); the "
                             "table needs both")
    parser.add_argument("--pretrain-steps", type=int, default=30_000)
    parser.add_argument("--pretrain-minutes", type=int, default=20)
    parser.add_argument("--pretrain-only", action="store_true")
    args = parser.parse_args()
    work = args.work.resolve()
    ckpt = pretrain(work, args.pretrain_steps, args.pretrain_minutes)
    if args.pretrain_only:
        return
    results = [arm(work, split, seed, init)
               for split in args.splits for seed in args.seeds for init in (None, ckpt)]
    if set(args.splits) != set(SPLITS):
        return
    text, summary = table(results, args.seeds)
    steps, val_mae = checkpoint_record(ckpt)
    text = (f"Pretrained on ZINC-full: {steps:,} steps, validation MAE {val_mae:.3f} (best checkpoint "
            f"of the run; the last one starts the fine-tuning).\n\n{text}")
    summary["pretrain"] = {"steps": steps, "val_mae": val_mae}
    (work / "finetune_esol.md").write_text(text + "\n")
    print(text)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
