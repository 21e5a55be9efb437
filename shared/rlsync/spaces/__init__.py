"""Space support: what the three Spaces share besides the sync library (panels, settings, role runner, bucket exchange, deploy, tiny model)."""
