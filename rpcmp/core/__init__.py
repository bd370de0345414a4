"""Shared by both sides of the wire: micro-batches, futures, failures as values, the served
object, health, policy, hyper-parameters, checkpoint files."""
