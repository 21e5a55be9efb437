"""The environment Space: publishes tasks, scores completions, writes rewards."""
