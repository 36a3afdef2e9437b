"""Studies of many fits: the seeded URPE-vs-RPE ablation (a grid study: its runs, results and
tables) and the hyperparameter search (its space, the callback inside each trial's fit), both on
one study machinery (``study.py``); the paper's synthetic sequence tasks."""
