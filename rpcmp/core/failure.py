"""A stage's failure as a value that travels back along the chain of RPCs.

[Note: failures travel as values]
An exception raised inside an RPC function is printed by ``torch.distributed.rpc`` on the
process that raised it and re-raised on the caller as text (``On WorkerInfo(...):
StageError('...')`` and the RPC traceback), each hop wrapping it once more: one failing
micro-batch gave the user 157 lines with the traceback three times. So a stage that fails
returns a :class:`Failure` instead of raising: the chain of ``rpcmp.owner.stage.forward`` futures hands it
back to the master as a result, typed, and the master raises one error with a one-line
message, the stage's own frames (``details``) and every frame (``full_traceback``, shown
by ``--debug``). Its type is the one raised on the owner when that is an rpcmp error (a
``PartitionError`` from building a stage, a ``StageOutputError`` from its output), found
by the class's name in :mod:`rpcmp.errors`, never by reading the message; any other
exception (the user's code) arrives as a :class:`StageError`.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

from .. import errors
from ..errors import RpcmpError, StageError

__all__ = ["Failure", "user_frames"]

# rpcmp's own package (this file is in rpcmp/core/) and the standard library
_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, os.path.dirname(os.path.abspath(traceback.__file__)))


@dataclass
class Failure:
    """What went wrong on an owner, ready to be raised on the master."""
    message: str
    details: str = ""
    full_traceback: str = ""
    kind: str = "StageError"  # the rpcmp error class raised on the owner, by name

    @classmethod
    def of(cls, message: str, exc: BaseException) -> "Failure":
        """A failure with ``message`` for the exception being handled."""
        kind = type(exc).__name__ if isinstance(exc, RpcmpError) and type(exc).__name__ in errors.__all__ else "StageError"
        return cls(message, user_frames(exc), "".join(traceback.format_exception(exc)), kind)

    def error(self) -> RpcmpError:
        """The error to raise on the master: of the owner's type, with both tracebacks."""
        cls = getattr(errors, self.kind, StageError)
        if issubclass(cls, StageError):
            return cls(self.message, self.details, self.full_traceback)
        error = cls(self.message)
        error.details, error.full_traceback = self.details, self.full_traceback
        return error


def user_frames(exc: BaseException) -> str:
    """``exc``'s traceback without the frames of rpcmp, torch and the standard library: where in
    the user's own code it was raised, and the exception itself."""
    import torch
    skip = _OURS + (os.path.dirname(os.path.abspath(torch.__file__)),)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(skip) and not f.filename.startswith("<")]
    text = "".join(traceback.format_list(frames))
    return ("Traceback (stage code):\n" + text if text else "") + "".join(traceback.format_exception_only(exc))
