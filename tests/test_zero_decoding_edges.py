"""Decoding (resident and streaming, zero/resident.py and zero/streaming.py) when something outside the
forwards changes what a rank holds, on 2 gloo ranks:

- ``empty_partition_cache`` (ZeroModel.release_all) between decoding forwards: on every rank, the next
  forwards compute exactly; on one rank only while streaming, FetchOrderError on every rank at the next
  forward (its gathers differ from the others'), then the ranks record again and compute exactly;
- a parameter from outside the model (another ZeroModel's) registered as external to one of its modules
  during decoding: on every rank, exact (gathered on demand, agreed); on one rank only while streaming,
  FetchOrderError on every rank.
(One rank only while the model is resident stays uncovered: see [Note: resident decoding].)
"""
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import rank

TIMEOUT = 120


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _case(resident: bool, action: str, ranks):
    from zero_ext.zero import FetchOrderError, ZeroModel, register_external_parameter

    torch.manual_seed(0)
    model, plain, outside = _Chain(), _Chain(), nn.Linear(8, 8)
    plain.load_state_dict(model.state_dict())
    limits = dict(max_live_parameters=10 ** 6) if resident else dict(max_live_parameters=200, max_reuse_distance=0)
    zm = ZeroModel(model, param_persistence_threshold=0, **limits)
    other = ZeroModel(outside, param_persistence_threshold=0)
    x = torch.randn(2, 8)
    same, raised, modes = [], [], []
    with torch.no_grad():
        for f in range(1, 11):
            if f == 6 and rank() in ranks:
                if action == "release":
                    zm.release_all(include_persistent=True)
                else:
                    register_external_parameter(model.layers[2], outside.weight)
            try:
                same.append(torch.equal(model(x), plain(x)))
            except FetchOrderError as exc:
                raised.append((f, str(exc)))
            c = zm.coordinator
            modes.append("resident" if c.residency is not None else "streaming" if c.streaming is not None else "-")
    zm.destroy()
    other.destroy()
    return same, raised, modes


def test_empty_partition_cache_on_every_rank_while_decoding_is_exact():
    for resident in (True, False):
        for same, raised, modes in run_ranks(2, _case, resident, "release", (0, 1), timeout=TIMEOUT):
            assert all(same) and not raised, (resident, same, raised)
            assert modes[4] == ("resident" if resident else "streaming") and modes[-1] == modes[4], modes


def test_empty_partition_cache_on_one_rank_while_streaming_is_a_named_error_on_every_rank():
    for same, raised, modes in run_ranks(2, _case, False, "release", (1,), timeout=TIMEOUT):
        assert [f for f, _ in raised] == [6], raised
        assert all(same) and modes[-1] == "streaming", (same, modes)  # recorded again, streaming again


def test_an_outside_parameter_registered_on_every_rank_while_decoding_is_gathered_on_demand():
    for resident in (True, False):
        for same, raised, modes in run_ranks(2, _case, resident, "external", (0, 1), timeout=TIMEOUT):
            assert all(same) and not raised, (resident, same, raised)


def test_an_outside_parameter_registered_on_one_rank_while_streaming_is_a_named_error_on_every_rank():
    for same, raised, modes in run_ranks(2, _case, False, "external", (1,), timeout=TIMEOUT):
        assert raised and raised[0][0] == 6, raised
        assert all(same), same
