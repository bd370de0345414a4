"""The in-order gate of a stage: micro-batches run in the master's order, whatever order
RPC threads bring them in.

The master numbers micro-batches (``seq``). A stage runs ``seq`` only after every earlier
one has run or been skipped (it failed upstream and will never come), so BatchNorm
statistics and timings are deterministic. A traced stage may also wait for values an
earlier stage posts straight to it (see [Note: skip values go straight to their consumer]
in :mod:`rpcmp.plan.traced`); they are kept here by ``seq`` until it runs.
"""
from __future__ import annotations

import threading

from ..errors import StageError, StepCancelled

__all__ = ["InOrder"]


class InOrder:
    """Admits numbered micro-batches one at a time, in order. ``who`` names the stage in errors."""

    def __init__(self, who: str, timeout: float, mail_names: tuple[str, ...] = ()):
        self.who, self.timeout, self.mail_names = who, timeout, tuple(mail_names)
        self.next = 0  # the micro-batch whose turn it is
        self._skipped: set[int] = set()
        self._cancelled: set[int] = set()
        self._mail: dict[int, dict] = {}
        self._cond = threading.Condition()

    def enter(self, seq: int) -> dict:
        """Wait until it is ``seq``'s turn (and its posted values are here); return those values."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.next >= seq or seq in self._cancelled, timeout=self.timeout):
                raise StageError(f"{self.who} waited {self.timeout:.0f}s for micro-batch {self.next} before {seq}; "
                                 f"an earlier micro-batch was lost upstream")
            if seq in self._cancelled:  # not run, and no later one waits for it
                self._skipped.add(seq)
                self._advance()
                raise StepCancelled(f"{self.who}: micro-batch {seq} not run, its step failed elsewhere")
            if not self.mail_names:
                return {}
            if not self._cond.wait_for(lambda: len(self._mail.get(seq, ())) == len(self.mail_names),
                                       timeout=self.timeout):
                missing = sorted(set(self.mail_names) - set(self._mail.get(seq, ())))
                raise StageError(f"{self.who} waited {self.timeout:.0f}s for values {missing} of micro-batch {seq} "
                                 f"from an earlier stage")
            return self._mail.pop(seq)

    def leave(self, seq: int) -> None:
        """``seq`` has run (or failed here): the next one may enter."""
        with self._cond:
            self.next = max(self.next, seq + 1)
            self._advance()

    def skip(self, seq: int) -> None:
        """Micro-batch ``seq`` failed before reaching this stage: later ones must not wait for it."""
        with self._cond:
            if seq >= self.next:
                self._skipped.add(seq)
                self._advance()

    def cancel(self, seqs: list[int]) -> None:
        """The step of ``seqs`` failed: those that have not entered yet fail at once instead of running
        (the master waits for every micro-batch of a failed step before it recovers or reports)."""
        with self._cond:
            self._cancelled.update(s for s in seqs if s >= self.next)
            self._cond.notify_all()

    def receive(self, seq: int, values: dict) -> None:
        """Values an earlier stage posted for ``seq``."""
        with self._cond:
            if seq >= self.next:  # not for a micro-batch that was skipped meanwhile
                self._mail.setdefault(seq, {}).update(values)
                self._cond.notify_all()

    def reset(self, next_seq: int) -> None:
        """After a failed step: the master's next micro-batch is ``next_seq``; forget the rest."""
        with self._cond:
            self.next = next_seq
            self._skipped.clear()
            self._cancelled.clear()
            self._mail.clear()
            self._cond.notify_all()

    def _advance(self) -> None:
        while self.next in self._skipped:
            self._skipped.discard(self.next)
            self.next += 1
        for old in [s for s in self._mail if s < self.next]:  # values of micro-batches that will not run
            del self._mail[old]
        self._cond.notify_all()
