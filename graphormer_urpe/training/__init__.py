"""Everything that runs Lightning: one fit (the Lightning module, its training step as one
replayable optimizer step, AdamW and the learning-rate schedule, fine-tuning from a checkpoint,
the run's checkpoints, the packaged recipes, the LightningCLI behind ``graphormer-urpe`` and the
refusals checked before any data is read; an OGB-LSC submission from a checkpoint) and the studies
of many fits (:mod:`.studies`)."""
