"""Does ``graphormer-urpe-hpopt`` beat the default recipe? ESOL's scaffold split, one split file
for every run, ``configs/csv.yaml`` (fine-tuned from the shipped backbone) as the base recipe.

Arms, each scored on the split's validation and test molecules through
``graphormer-urpe-predict`` on its best-on-validation checkpoint (RMSE and MAE):

- ``default@<E>``: ``graphormer-urpe fit --config configs/csv.yaml`` at the search's epochs;
- ``search best@<E>``: the best-on-validation trial of ``graphormer-urpe-hpopt`` (``--n-trials``
  trials of ``--trial-epochs`` epochs over :data:`SPACE`, TPE, median pruning);
- ``default@25`` and ``best.yaml@25`` (unless ``--no-full``): the recipe's own 25 epochs, as it
  is and with the search's ``best.yaml`` (``fit --config configs/csv.yaml --config best.yaml``).

Every run uses one torch thread and one process at a time; a finished arm (``result.json``) is not
repeated and the search resumes its study. Prints a table and, last, one JSON line.

    python scripts/bench_hpopt.py [--n-trials 10] [--trial-epochs 10] [--work runs/bench_hpopt]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_small_data import ESOL, ESOL_TARGET, REPO, run_logged, score, write_splits  # noqa: E402

from graphormer_urpe.prediction.load import best_checkpoint  # noqa: E402

#: The search space: what a fine-tuning run can change (the architecture is the pretrained backbone's).
SPACE = {
    "model.lr": {"type": "float", "low": 1e-4, "high": 2e-3, "log": True},
    "model.weight_decay": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
    "model.backbone.dropout": {"type": "categorical", "choices": [0.0, 0.1, 0.2]},
    "data.init_args.batch_size": {"type": "categorical", "choices": [16, 32, 64]},
}
RECIPE_EPOCHS = 25  # configs/csv.yaml's trainer.max_epochs
STUDY = "esol_scaffold"


def command(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def common_args(args: argparse.Namespace, split_file: Path) -> list[str]:
    return ["--data.init_args.path", str(args.csv), "--data.init_args.split_file", str(split_file),
            "--data.init_args.cache_root", str(args.work / "cache"), "--data.init_args.encode_threads", "1",
            "--data.init_args.build_workers", "1", "--trainer.enable_progress_bar", "false"]


def split_csvs(args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    """The scaffold split file (seed 0) and its validation and test molecules as CSVs."""
    import pandas as pd

    splits = argparse.Namespace(csv=args.csv, splits=["scaffold"], seeds=[0], smiles_column="smiles",
                                target_column=ESOL_TARGET)
    split_file = write_splits(splits, args.work)[("scaffold", 0)]
    rows = json.loads(split_file.read_text())[0]
    table = pd.read_csv(args.csv)
    csvs = {"test": split_file.with_suffix(".test.csv"), "val": split_file.with_suffix(".val.csv")}
    if not csvs["val"].is_file():
        table.iloc[rows["val"]][["smiles", ESOL_TARGET]].to_csv(csvs["val"], index=False)
    return split_file, csvs


def scored(run_dir: Path, csvs: dict[str, Path], row: dict) -> dict:
    """``row`` with the best checkpoint's validation MAE and its val / test RMSE and MAE."""
    best, val_mae, step, *_ = best_checkpoint(run_dir)
    row.update(best_checkpoint=str(best), best_step=step, val_mae_monitored=val_mae)
    for name, csv in csvs.items():
        predictions = run_dir / f"{name}_predictions.csv"
        if not predictions.is_file():
            run_logged([command("graphormer-urpe-predict"), "--ckpt", str(best), "--input", str(csv),
                        "--output", str(predictions), "--workers", "0", "--quiet"], run_dir / "predict.log")
        row[f"{name}_rmse"], row[f"{name}_mae"] = score(predictions, csv, ESOL_TARGET)
    return row


def cached(result_file: Path, make) -> dict:
    if result_file.is_file():
        return json.loads(result_file.read_text())
    row = make()
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(row))
    return row


def fit_arm(args, name: str, split_file: Path, csvs: dict, extra: list[str]) -> dict:
    run_dir = args.work / name.replace("@", "_at_").replace(" ", "_").replace(".", "_")

    def make() -> dict:
        started = time.perf_counter()
        run_logged([command("graphormer-urpe"), "fit", "--config", str(REPO / "configs" / "csv.yaml"),
                    *common_args(args, split_file), "--trainer.default_root_dir", str(run_dir),
                    "--checkpoint.overwrite", "true", *extra], run_dir.with_suffix(".log"))
        return scored(run_dir, csvs, {"arm": name, "wall_s": round(time.perf_counter() - started, 1)})

    row = cached(run_dir / "result.json", make)
    print(f"{name}: val RMSE {row['val_rmse']:.3f}, test RMSE {row['test_rmse']:.3f} ({row['wall_s']:.0f} s)",
          flush=True)
    return row


def search_arm(args, split_file: Path, csvs: dict) -> tuple[dict, dict]:
    """The search (resumable), then its best trial scored; also the study's trials."""
    import optuna

    space_file = args.work / "space.yaml"
    space_file.parent.mkdir(parents=True, exist_ok=True)
    space_file.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    runs = args.work / "hpopt"
    started = time.perf_counter()
    run_logged([command("graphormer-urpe-hpopt"), "--space", str(space_file), "--config",
                str(REPO / "configs" / "csv.yaml"), "--study", STUDY, "--runs-dir", str(runs),
                "--n-trials", str(args.n_trials), "--seed", "0", "--startup-trials", str(args.startup_trials),
                *(["--timeout", args.search_timeout] if args.search_timeout else []),
                *common_args(args, split_file), "--trainer.max_epochs", str(args.trial_epochs)],
               args.work / "hpopt.log")
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{runs / STUDY / 'study.db'}")
    trials = [{"number": t.number, "state": t.state.name, "val_mae": t.value,
               "validations": len(t.intermediate_values), "params": t.params,
               "wall_s": t.duration.total_seconds() if t.duration else None} for t in study.trials]
    best = study.best_trial
    row = cached(runs / STUDY / "result.json", lambda: scored(
        Path(best.user_attrs["run_dir"]), csvs,
        {"arm": f"search best@{args.trial_epochs}", "trial": best.number, "params": best.params,
         "wall_s": round(time.perf_counter() - started, 1)}))
    print(f"{row['arm']} (trial {row['trial']}): val RMSE {row['val_rmse']:.3f}, test RMSE "
          f"{row['test_rmse']:.3f}", flush=True)
    return row, {"trials": trials, "best_yaml": str(runs / STUDY / "best.yaml")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=ESOL)
    parser.add_argument("--n-trials", type=int, default=10)
    parser.add_argument("--trial-epochs", type=int, default=10, help="max_epochs of each trial")
    parser.add_argument("--startup-trials", type=int, default=4)
    parser.add_argument("--search-timeout", help="the search's --timeout (e.g. 25m): no trial starts after it")
    parser.add_argument("--no-full", action="store_true",
                        help=f"leave out the {RECIPE_EPOCHS}-epoch runs (default and best.yaml)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_hpopt")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    args.csv, args.work = args.csv.resolve(), args.work.resolve()
    split_file, csvs = split_csvs(args)

    epochs = ["--trainer.max_epochs", str(args.trial_epochs)]
    rows = [fit_arm(args, f"default@{args.trial_epochs}", split_file, csvs, epochs)]
    best_row, study = search_arm(args, split_file, csvs)
    rows.append(best_row)
    if not args.no_full:
        rows.append(fit_arm(args, f"default@{RECIPE_EPOCHS}", split_file, csvs, []))
        rows.append(fit_arm(args, f"best.yaml@{RECIPE_EPOCHS}", split_file, csvs, ["--config", study["best_yaml"]]))

    print(f"\nESOL scaffold split ({len(json.loads(split_file.read_text())[0]['val'])} val, "
          f"{len(json.loads(split_file.read_text())[0]['test'])} test molecules), configs/csv.yaml; "
          f"search: {args.n_trials} trials x {args.trial_epochs} epochs")
    print("| arm | best val MAE (monitored) | val RMSE | val MAE | test RMSE | test MAE | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['arm']} | {row['val_mae_monitored']:.3f} | {row['val_rmse']:.3f} | {row['val_mae']:.3f} "
              f"| {row['test_rmse']:.3f} | {row['test_mae']:.3f} | {row['wall_s']:.0f} |")
    states = [t["state"] for t in study["trials"]]
    print(f"trials: {', '.join(f'{states.count(s)} {s.lower()}' for s in sorted(set(states)))}; "
          f"best params: {best_row['params']}")
    summary = {"csv": args.csv.name, "split": "scaffold", "split_file_seed": 0, "recipe": "configs/csv.yaml",
               "space": SPACE, "n_trials": args.n_trials, "trial_epochs": args.trial_epochs,
               "startup_trials": args.startup_trials, "search_timeout": args.search_timeout, "rows": rows, "trials": study["trials"],
               "command": shlex.join(["python", "scripts/bench_hpopt.py", *sys.argv[1:]])}
    line = json.dumps(summary)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    main()
