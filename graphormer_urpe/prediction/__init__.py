"""Prediction from trained checkpoints without Lightning: the model (:mod:`.model`), loading
checkpoints and run directories (:mod:`.load`), the output table (:mod:`.table`), a SMILES file
predicted with its outputs (:mod:`.run`), scores against measured values (:mod:`.uncertainty`),
embeddings (:mod:`.embeddings`), attributions (:mod:`.explain`) and the shipped backbones
(:mod:`.pretrained`)."""
