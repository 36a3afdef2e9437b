from graphormer_urpe.lightning_private import *  # noqa: F401,F403 - the old path, for engine.py and run_checkpoint.py
