"""The `rpcmp` command: click commands and the plan report."""
from .commands import job_options, main

__all__ = ["main", "job_options"]
