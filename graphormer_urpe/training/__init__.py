"""Training: the Lightning module around the backbone, its training step, AdamW and the LR
schedule, fine-tuning from a checkpoint, the run's checkpoints, and the ``graphormer-urpe`` CLI."""
