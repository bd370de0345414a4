"""`python -m rpcmp.cli ...`: the `rpcmp` command where its script is not on PATH (launch/*.sh use it)."""
from .commands import main
from .leave import program

program(main)
