"""Adapters that let other trainers draw their rollouts from a rollfleet fleet (``trl``)."""
