"""The trainer Space: owns the weights, learns from scored rollouts, publishes to the bucket."""
