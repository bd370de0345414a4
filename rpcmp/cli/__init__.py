"""The `rpcmp` command: click commands and the plan report."""
from .commands import job_options, main
from .leave import program

__all__ = ["main", "job_options", "console"]


def console() -> None:
    """The ``rpcmp`` console script: :data:`main`, ended without the interpreter's teardown (:func:`program`)."""
    program(main)
