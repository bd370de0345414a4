import pytest

from rpcmp.errors import PlacementError
from rpcmp.plan.placement import Place, resolve_placement


def test_auto():
    assert [str(p) for p in resolve_placement("auto", 3, 3)] == ["worker1/cpu", "worker2/cpu", "master/cpu"]
    assert [str(p) for p in resolve_placement("auto", 2, 4)] == ["worker1/cpu", "worker2/cpu"]


def test_explicit():
    places = resolve_placement(["worker1/cuda", "master", "worker1/cpu"], 3, 2)
    assert places == [Place("worker1", "cuda:0"), Place("master", "cpu"), Place("worker1", "cpu")]
    assert places[0].rank == 1 and places[1].rank == 0


def test_errors_show_the_arithmetic_and_valid_names():
    with pytest.raises(PlacementError, match=r"3 stages > 2 processes \(master, worker1\)"):
        resolve_placement("auto", 3, 2)
    with pytest.raises(PlacementError, match=r"'worker7'.*names are \['master', 'worker1', 'worker2'\]"):
        resolve_placement(["worker1/cpu", "worker7/cpu"], 2, 3)
    with pytest.raises(PlacementError, match="2 entries but there are 3 stages"):
        resolve_placement(["worker1/cpu", "worker2/cpu"], 3, 3)
    with pytest.raises(PlacementError, match="not a device"):
        resolve_placement(["worker1/gpu0"], 1, 2)
    with pytest.raises(PlacementError, match="'auto' or a list"):
        resolve_placement("worker1", 1, 2)
