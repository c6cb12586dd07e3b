"""zero.Init: DeepSpeed's ds_* attributes answer as soon as a module's constructor has returned.

DeepSpeed partitions at the end of each ``__init__``; zero_ext partitions at the next torch call after
it, so a ds_* read in between (``m = nn.Linear(...)`` then ``m.weight.ds_tensor``, or a parent
constructor reading a child's ``ds_numel``) partitions the ready parameters first (init.py,
pending_class). Inside the parameter's own constructor the attributes are still missing, as in DeepSpeed.
(Reading ``.data`` under zero.Init still gives the full value: zero_ext's exact initialisation.)
"""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks


class ReadsItsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 6)
        # the child's constructor has returned: DeepSpeed has partitioned it, and so must we
        self.seen = (self.child.weight.ds_numel, tuple(self.child.weight.ds_shape),
                     self.child.weight.ds_tensor.numel())
        self.own = nn.Parameter(torch.ones(3))
        self.own_has_ds_id = hasattr(self.own, "ds_id")  # its constructor (this one) still runs


def _facade_right_after_construction():
    import zero_ext
    from zero_ext.zero import ZeroParamStatus

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    want = nn.Linear(5, 3)
    torch.manual_seed(0)
    with zero_ext.zero.Init():
        m = nn.Linear(5, 3)
        w = m.weight
        piece = w.ds_tensor.clone()  # read before any other torch call
        facade = (w.ds_id, tuple(w.ds_shape), w.ds_numel, w.ds_status)
        try:
            w.not_an_attribute
            missing = None
        except AttributeError as e:
            missing = str(e)
        parent = ReadsItsChild()
    n = -(-15 // world)
    expected = torch.zeros(n * world)
    expected[:15] = want.weight.detach().reshape(-1)
    return {"piece_ok": torch.equal(piece, expected[rank * n:(rank + 1) * n]), "facade": facade,
            "status": ZeroParamStatus.NOT_AVAILABLE, "n": n, "missing": missing, "parent": parent.seen,
            "own_has_ds_id": parent.own_has_ds_id, "own_after": hasattr(parent.own, "ds_id"),
            "class_after": type(m.weight).__mro__[1] is nn.Parameter or type(m.weight) is nn.Parameter}


@pytest.mark.parametrize("world", [1, 2])
def test_ds_attributes_read_right_after_construction_show_the_partition(world):
    for out in run_ranks(world, _facade_right_after_construction):
        _, shape, numel, status = out["facade"]
        assert out["piece_ok"], "ds_tensor is not this rank's piece of rank 0's value"
        assert (shape, numel, status) == ((3, 5), 15, out["status"])
        assert out["missing"] is not None and "not_an_attribute" in out["missing"]
        assert out["parent"] == (24, (6, 4), -(-24 // world))
        assert not out["own_has_ds_id"] and out["own_after"]
        assert out["class_after"]


def _left_whole_after_a_raise():
    import zero_ext

    class Boom(RuntimeError):
        pass

    kept = {}
    with pytest.raises(Boom):
        with zero_ext.zero.Init():
            kept["m"] = nn.Linear(2, 2)
            raise Boom()
    w = kept["m"].weight
    return type(w) is nn.Parameter, hasattr(w, "ds_id"), w.numel()


def test_a_parameter_left_whole_gets_its_own_class_back():
    assert run_ranks(1, _left_whole_after_a_raise)[0] == (True, False, 4)
