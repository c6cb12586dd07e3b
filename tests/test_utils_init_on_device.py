"""OnDevice (zero_ext/utils/init_on_device.py, DeepSpeed's ``deepspeed.OnDevice``): a module built inside
the block has its tensors on the device, floating ones in the dtype; explicit choices and integer tensors
are kept, and nothing stays changed after the block (also when it raises)."""
import pytest
import torch

from zero_ext.utils import OnDevice


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(5, 3))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_module_built_on_the_device_in_the_dtype(device):
    with OnDevice(dtype=torch.float16, device=device):
        model = _model()
        steps = torch.arange(3)
        wide = torch.zeros(2, dtype=torch.float64)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {(device, torch.float16)}
    assert steps.dtype == torch.int64 and steps.device.type == device  # integers keep their dtype
    assert wide.dtype == torch.float64  # an explicit dtype is kept


def test_block_leaves_nothing_behind_and_can_be_disabled():
    with pytest.raises(RuntimeError, match="inside"):
        with OnDevice(dtype=torch.bfloat16, device="meta"):
            raise RuntimeError("inside")
    after = torch.nn.Linear(2, 2)
    assert after.weight.device.type == "cpu" and after.weight.dtype == torch.float32
    with OnDevice(dtype=torch.float16, device="meta", enabled=False):
        off = torch.nn.Linear(2, 2)
    assert off.weight.device.type == "cpu" and off.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="floating-point"):
        OnDevice(dtype=torch.int8)


def test_deepspeed_names():
    from helpers.compat_site import import_checkout_compat

    ds = import_checkout_compat()
    from deepspeed.utils.init_on_device import OnDevice as by_path

    assert ds.OnDevice is ds.utils.OnDevice is by_path is OnDevice
