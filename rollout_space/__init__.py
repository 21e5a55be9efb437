"""The rollout fleet: replicas that follow the bucket and generate completions."""

from rlsync.registry import add_home

add_home(f"{__name__}.engines")  # the rollout engines, one module each
