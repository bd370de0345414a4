"""Runs beside a stage, in the process that owns it: the stage host and its endpoints, state, admission, recompute, gradient merge and reduce."""
