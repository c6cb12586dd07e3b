"""The host staging buffer of an offloaded 16-bit model (zero_optimizer._lp_target / _lp_upload): after
an asynchronous upload from pinned memory, the buffer is handed to the next step's kernel only once the
event recorded after that copy completed. On CUDA the event is torch.cuda.Event; here (no GPU) the
group's parameters are on the meta device (not host memory, so the staging path runs) and the event
is a stand-in that records when it was waited on."""
import types

import torch

from zero_ext.optim.zero_optimizer import _lp_target, _lp_upload


class _Event:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("waited")


def _group():
    flat = torch.empty(8, dtype=torch.bfloat16, device="meta")  # "on the device": not host memory
    return types.SimpleNamespace(flat=flat, lo=0, hi=8, dtype=torch.bfloat16, master=torch.zeros(8),
                                 host=types.SimpleNamespace(pin=False))


def test_the_staging_buffer_is_handed_out_again_only_after_the_last_upload_completed():
    g, log = _group(), []
    first = _lp_target(g)
    assert first.device.type == "cpu" and first.numel() == 8 and first.dtype == torch.bfloat16
    _lp_upload(g, first)  # not pinned, not CUDA: a synchronous copy, nothing to wait for
    assert getattr(g, "staging_copied", None) is None
    g.staging_copied = _Event(log)  # what an upload from pinned memory to a GPU leaves behind
    log.append("next step")
    again = _lp_target(g)
    assert log == ["next step", "waited"] and again is first and g.staging_copied is None
    assert _lp_target(g) is first and log == ["next step", "waited"]  # waited once, not every call
