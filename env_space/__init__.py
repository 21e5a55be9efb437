"""The environment Space: publishes tasks, scores completions, writes rewards."""

from rlsync.registry import add_home

add_home(__name__)  # environments register in the package's modules (env_space.environments)
