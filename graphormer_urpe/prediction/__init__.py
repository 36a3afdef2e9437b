"""Prediction from trained checkpoints without Lightning: the models (:mod:`.model`), loading
checkpoints and run directories (:mod:`.load`), the input rows and the output table
(:mod:`.table`), an input predicted chunk by chunk (:mod:`.run`), scores against measured values
(:mod:`.uncertainty`), attributions (:mod:`.explain`) and the shipped backbones
(:mod:`.pretrained`). Writing files is the commands' (:mod:`graphormer_urpe.cli`)."""
