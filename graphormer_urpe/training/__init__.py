"""Lightning training: the module around the backbone, the LR schedule, the CLI."""
