"""Export to Hugging Face: consolidated weights (full, merged LoRA or the adapter) from a
checkpoint or the end of a run, and `shardwise export`."""
