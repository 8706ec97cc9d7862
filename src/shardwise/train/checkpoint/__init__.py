"""Training checkpoints: the sharded state any engine and world size resumes, the run's
checkpoints directory, the safe reader of a DCP index, run lineage and the resume checks."""
