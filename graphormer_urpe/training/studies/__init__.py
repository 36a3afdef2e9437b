"""Studies of many fits: the seeded URPE-vs-RPE ablation (runs in time slices, their results and
tables), the hyperparameter search (its space, its Optuna study, the callback inside each trial's
fit), the paper's synthetic sequence tasks, and the figures of the learned URPE tables."""
