"""zero/linear.py: DeepSpeed's LinearModuleForZeroStage3 computes nn.Linear's values and gradients, follows
the caller's autocast in forward and backward, and its decorators are torch.amp's for the device."""
import functools

import torch

from zero_ext.zero.linear import LinearModuleForZeroStage3, autocast_custom_bwd, autocast_custom_fwd


def _pair(shape):
    torch.manual_seed(0)
    ours = LinearModuleForZeroStage3(6, 3)
    plain = torch.nn.Linear(6, 3)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(*shape, 6)
    return ours, plain, x


def test_values_and_gradients_are_nn_linears():
    for shape in ((4,), (5, 4), (2, 5, 4)):
        ours, plain, x = _pair(shape[:-1] or ())
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), plain(xb)
        torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)
        (ya * ya).sum().backward()
        (yb * yb).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
        for a, b in zip(ours.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_follows_the_callers_autocast():
    ours, plain, x = _pair((5,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
        ref = plain(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and ours.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert ours(x).dtype == torch.float32


def test_decorators_are_torch_amps_for_the_device():
    for deco, fn in ((autocast_custom_fwd, torch.amp.custom_fwd), (autocast_custom_bwd, torch.amp.custom_bwd)):
        assert isinstance(deco, functools.partial) and deco.func is fn and deco.keywords == {"device_type": "cpu"}
