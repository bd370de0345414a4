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

import os

import click

from ..cli.commands import job_options
from ..errors import JobError

__all__ = ["main"]


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@job_options
def main(job_file, overrides):
    """Run JOB_FILE as one rank of a torchrun job."""
    from ..launch.runtime import run_rank
    from ..train.trainer import fit
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise JobError(f"python -m rpcmp.master runs under torchrun, but {missing} are not set: "
                       f"launch it with torchrun (see `python -m rpcmp.master --help`), or use `rpcmp run JOB --local N`")
    run_rank(job_file, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), fit, overrides)


if __name__ == "__main__":
    main()
