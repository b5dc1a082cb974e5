"""The training job: what every launcher runs, in parts (the preflight step first)."""
