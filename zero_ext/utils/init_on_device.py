"""``deepspeed.OnDevice``: build a module's tensors straight on a device (``"meta"``: no memory at all) and,
for floating-point ones, in a dtype::

    with OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()          # every parameter a float16 meta tensor

Built on torch's function modes (``torch.device`` as a context, and a mode of ours for the dtype) rather
than by replacing ``torch.empty`` & co: tensors made by any factory function are covered, and nothing
global is left patched if the block raises. A factory call that names its ``device`` or ``dtype`` keeps
it (DeepSpeed converts an explicit floating dtype too).
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors


class _FloatingDtype(TorchFunctionMode):
    """Floating-point tensors made by a factory function without an explicit dtype come out in ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in self.factories and kwargs.get("dtype") is None and isinstance(out, torch.Tensor)
                and out.is_floating_point() and out.dtype != self.dtype):
            out = out.to(self.dtype)
        return out


class OnDevice:
    """Tensors made inside the block are on ``device``, floating-point ones in ``dtype`` (None: unchanged);
    ``enabled=False`` makes the block do nothing."""

    def __init__(self, dtype=None, device="meta", enabled: bool = True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"OnDevice(dtype={dtype!r}): give a floating-point torch dtype (e.g. torch.float16) "
                             "or None")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._modes = []

    def __enter__(self):
        if self.enabled:
            self._modes = [torch.device(self.device)] + ([_FloatingDtype(self.dtype)] if self.dtype else [])
            for mode in self._modes:
                mode.__enter__()
        return self

    def __exit__(self, *exc):
        while self._modes:
            self._modes.pop().__exit__(*exc)
        return False


__all__ = ["OnDevice"]
