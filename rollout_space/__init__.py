"""The rollout fleet: replicas that follow the bucket and generate completions."""
