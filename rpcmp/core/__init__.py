"""Shared by both sides of the wire: micro-batches, the wire formats, futures, failures as values,
the served object, health, policy, hyper-parameters, checkpoint files."""
