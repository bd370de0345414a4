"""Drives the stages from rank 0: the pipeline, its executor and inbox, state gathering, replicas, tied parameters."""
