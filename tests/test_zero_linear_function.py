"""zero3_linear_wrap / LinearFunctionForZeroStage3 (zero_ext/zero/linear.py, DeepSpeed's
``deepspeed.runtime.zero.linear``): F.linear's values and gradients, under torch.func transforms, and
the backward under the forward's autocast state rather than the caller's."""
import pytest
import torch

from zero_ext.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap


def _tensors(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("x_shape", [(8,), (3, 8), (2, 3, 8)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_and_gradients_match_f_linear(x_shape, with_bias):
    x, w, b = _tensors(x_shape, (4, 8), (4,))
    b = b if with_bias else None
    out = zero3_linear_wrap(x, w, b)
    assert type(out.grad_fn).__name__.startswith("LinearFunctionForZeroStage3")
    out.pow(2).sum().backward()
    ours = [t.grad for t in (x, w, b) if t is not None]
    ref_in = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    torch.nn.functional.linear(*ref_in).pow(2).sum().backward()
    torch.testing.assert_close(out, torch.nn.functional.linear(*ref_in))
    for got, ref in zip(ours, ref_in):
        torch.testing.assert_close(got, ref.grad)


def test_torch_func_grad_and_vmap():
    x, w, b = _tensors((3, 8), (4, 8), (4,))
    grads = torch.func.grad(lambda w_, x_: zero3_linear_wrap(x_, w_, b).sum(), argnums=(0, 1))(w, x)
    ref = torch.func.grad(lambda w_, x_: torch.nn.functional.linear(x_, w_, b).sum(), argnums=(0, 1))(w, x)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want)
    y = torch.func.vmap(lambda xi: LinearFunctionForZeroStage3.apply(xi, w, b).sum())(x)
    torch.testing.assert_close(y, (x @ w.t() + b).sum(-1))


def test_backward_keeps_the_forwards_autocast_state():
    x, w = _tensors((2, 8), (4, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = zero3_linear_wrap(x, w)
    assert half.dtype == torch.bfloat16 and half.grad_fn._fwd_used_autocast is True
    half.float().sum().backward()
    assert w.grad.dtype == x.grad.dtype == torch.float32
    x.grad = w.grad = None
    full = zero3_linear_wrap(x, w)
    assert full.grad_fn._fwd_used_autocast is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's autocast does not reach the backward
        full.sum().backward()
    ref_w = torch.ones(2, 4).t() @ x.detach()
    torch.testing.assert_close(w.grad, ref_w)  # exact fp32 result, not a bf16-rounded one
