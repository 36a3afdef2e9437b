"""Prediction from trained checkpoints without Lightning: the model (:mod:`.model`), loading
checkpoints and run directories (:mod:`.load`), and the output table (:mod:`.table`)."""
