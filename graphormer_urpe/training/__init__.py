"""Training and prediction: the module around the backbone, the LR schedule, the CLI, verified
checkpoints, the model without Lightning and the prediction table."""
