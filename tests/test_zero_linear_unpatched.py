"""zero_optimization.memory_efficient_linear, true or false (DeepSpeed-Chat's configs set false): zero_ext
never swaps torch.nn.functional.linear, the weight is released (partitioned) after forward either way, and
gradients are the plain model's."""
import pytest
import torch
import torch.nn.functional as F

from helpers.harness import run_ranks


def _linear_step(memory_efficient_linear):
    import zero_ext
    from zero_ext.zero import ZeroParamStatus

    torch.manual_seed(3)
    model = torch.nn.Linear(6, 5)
    linear_before = F.linear
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "memory_efficient_linear": memory_efficient_linear}}
    engine = zero_ext.initialize(model=model, config=config)[0]
    x = torch.linspace(-1, 1, 12).reshape(2, 6)
    out = engine(x)
    status = engine.module.weight.ds_status
    held = engine.module.weight.ds_tensor.numel(), engine.module.weight.numel()  # own piece; .data empty
    engine.backward(out.pow(2).sum())
    grad = zero_ext.utils.safe_get_full_grad(engine.module.weight).clone()
    engine.step()
    unpatched = F.linear is linear_before is torch._C._nn.linear
    engine.destroy()
    return unpatched, status == ZeroParamStatus.NOT_AVAILABLE, held, out.detach(), grad


@pytest.mark.parametrize("memory_efficient_linear", [True, False])
def test_linear_is_torchs_the_weight_is_released_after_forward_and_grads_are_exact(memory_efficient_linear):
    torch.manual_seed(3)
    ref = torch.nn.Linear(6, 5)
    x = torch.linspace(-1, 1, 12).reshape(2, 6)
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()
    for unpatched, released, held, out, grad in run_ranks(2, _linear_step, memory_efficient_linear):
        assert unpatched and released
        assert held == (15, 0), held  # 30 elements over 2 ranks; nothing gathered kept for backward
        torch.testing.assert_close(out, ref_out.detach())
        torch.testing.assert_close(grad, ref.weight.grad)  # the mean over two ranks of the same batch
