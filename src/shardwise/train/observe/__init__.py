"""What a run reports: progress and JSONL metrics, step records with the non-finite guard, and
the experiment trackers."""
