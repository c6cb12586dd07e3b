"""zero_ext.ops: DeepSpeed's deepspeed.ops CPU optimizers over zero_ext's C kernels.

    from zero_ext.ops.adam import DeepSpeedCPUAdam      # as deepspeed.ops.adam.DeepSpeedCPUAdam
    from zero_ext.ops.adagrad import DeepSpeedCPUAdagrad
    from zero_ext.ops.lion import DeepSpeedCPULion

The kernels themselves, on lists of tensors, are in zero_ext.ops.functional (adam_step,
adagrad_step, lion_step, grad_sqnorm, cast_). Their threads follow torch.get_num_threads() unless
set_num_threads() fixes them.

Files:
- adam.py, adagrad.py, lion.py: CPUAdam, CPUAdagrad, CPULion (and DeepSpeed's names for them).
- fused_adam.py: FusedAdam, DeepSpeed's deepspeed.ops.adam.FusedAdam: the C Adam on host tensors, torch's
  fused kernel on accelerator tensors.
- _optimizer.py: CPUOptimizer, what the three share (state on host_buffers, the fused offloaded step).
- functional.py: the C kernels as functions on lists of tensors; the thread and ISA controls.
- device_math.py: the same updates with torch operations, for sub-groups kept on an accelerator.
- quantize.py: block quantization (int8 / int4 with fp32 scales), ZeRO++'s wire formats, in C.
- records.py: a quantized collective's records (pieces quantized or raw, then scales), packed and unpacked
  in one C call each (qwZ, qgZ).
- torch_stepped.py: TorchStepped, torch_adam's torch.optim.Adam(W) behind this interface (NVMe offload).
"""
from .adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from .adam import CPUAdam, DeepSpeedCPUAdam
from .functional import available_isas, get_num_threads, set_num_threads
from .lion import CPULion, DeepSpeedCPULion

__all__ = [
    "CPUAdam", "DeepSpeedCPUAdam", "CPUAdagrad", "DeepSpeedCPUAdagrad", "CPULion", "DeepSpeedCPULion",
    "set_num_threads", "get_num_threads", "available_isas",
]
