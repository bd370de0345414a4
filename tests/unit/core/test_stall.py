"""The watchdog's reading of a stalled step (rpcmp.core.stall): idle processes for long enough, during a
step, said once; a gap in the readings (the whole job stopped and continued) or any work starts again."""
from rpcmp.core import stall
from rpcmp.core.served import RunStatus


class _Clock:
    def __init__(self):
        self.now, self.cpu = 100.0, {"master": 1.0, "worker1": 2.0}


def _stalls(monkeypatch, clock, **kw):
    s = stall.Stalls(hang_timeout=2.0, **kw)
    monkeypatch.setattr(stall.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(s, "_read", lambda workers: dict(clock.cpu))
    return s


def _tick(s, clock, status, seconds=1.0, busy=()):
    clock.now += seconds
    for p in busy:
        clock.cpu[p] += 0.5 * seconds
    return s.look(["worker1"], status)


def test_idle_processes_in_a_step_are_said_once_after_three_hang_timeouts(monkeypatch):
    clock, status = _Clock(), RunStatus(in_step=True)
    s = _stalls(monkeypatch, clock)
    said = [_tick(s, clock, status) for _ in range(10)]
    assert said.index("warn") == 6 and said.count("warn") == 1  # 6 s idle after the first reading
    status.in_step = False  # the step ended: a new one may warn again
    assert _tick(s, clock, status) is None
    status.in_step = True
    assert [_tick(s, clock, status) for _ in range(8)].count("warn") == 1


def test_work_or_a_gap_in_the_readings_starts_the_count_again(monkeypatch):
    clock, status = _Clock(), RunStatus(in_step=True)
    s = _stalls(monkeypatch, clock, stall_timeout=4.0)
    said = [_tick(s, clock, status) for _ in range(4)]
    said.append(_tick(s, clock, status, busy=["worker1"]))  # one process works: not a stall
    said += [_tick(s, clock, status) for _ in range(3)]
    said.append(_tick(s, clock, status, seconds=30.0))  # the job was stopped for 30 s: no reading meanwhile
    said += [_tick(s, clock, status) for _ in range(3)]
    assert "end" not in said
    assert _tick(s, clock, status) == "end"  # 4 idle seconds since the readings began again


def test_no_step_in_flight_is_never_a_stall(monkeypatch):
    clock, status = _Clock(), RunStatus()
    s = _stalls(monkeypatch, clock)
    assert all(_tick(s, clock, status) is None for _ in range(20))


def test_once_a_stop_is_asked_a_stalled_step_ends_the_run_after_stopping_after_seconds(monkeypatch):
    """[Note: stopping a run] waits for the step in flight; a stalled one never ends, so SIGTERM (timeout, a
    scheduler) waited forever unless sent twice."""
    from rpcmp.core.served import current
    from rpcmp.train.stop import StopRequest
    clock, status = _Clock(), RunStatus(in_step=True)
    s = _stalls(monkeypatch, clock)
    assert [_tick(s, clock, status) for _ in range(5)] == [None] * 5  # idle, and no stop asked
    stop = StopRequest(enabled=False)
    monkeypatch.setattr(current(), "stop", stop)
    assert _tick(s, clock, status) is None  # asked for nothing yet
    stop.signum = 15  # SIGTERM, taken
    assert _tick(s, clock, status) == "stop"  # idle 5 s and more: the step will not end
    s = _stalls(monkeypatch, clock)  # a step that works is waited for, stop asked or not
    assert all(_tick(s, clock, status, busy=["worker1"]) is None for _ in range(10))
