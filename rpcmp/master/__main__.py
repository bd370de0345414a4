"""Entry point for every rank under torchrun: rank 0 drives, the others serve stages.

Three nodes, one process each (run the same command on every node)::

    torchrun --nnodes=3 --nproc-per-node=1 --rdzv-backend=c10d \\
             --rdzv-endpoint=NODE0:29400 -m rpcmp.master examples/unet_split/job.py

One machine, three processes::

    torchrun --standalone --nproc-per-node=3 -m rpcmp.master examples/unet_split/job.py

Rank, world size and the rendezvous address come from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""
from __future__ import annotations

import sys

import click

from ..cli.options import job_options
from ..errors import JobError

__all__ = ["main"]


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@job_options
def main(job_file, overrides):
    """Run JOB_FILE as one rank of a torchrun job."""
    from ..launch.env import LaunchEnv
    from ..launch.runtime import run_rank
    from ..train.stop import exit_status
    from ..train.trainer import fit
    env = LaunchEnv.read()
    if env.missing:
        raise JobError(f"python -m rpcmp.master runs under torchrun, but {list(env.missing)} are not set: "
                       f"launch it with torchrun (see `python -m rpcmp.master --help`), or use `rpcmp run JOB --local N`")
    status = exit_status(run_rank(job_file, env.rank, env.world_size, fit, overrides))
    if status:  # stopped by a signal between two steps: see [Note: stopping a run]
        sys.exit(status)


if __name__ == "__main__":
    from ..cli.leave import program
    program(main)
