"""The collective facade's one addition to torch.distributed: all_gather_into, with the list-form fallback
for backends without all_gather_into_tensor, gives the same rank-major result either way (also when the
input is a view of the output, as the engine passes it)."""
import torch

from helpers.harness import run_ranks


def _gather_both_ways():
    from zero_ext.comm import collectives

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = []
    for forced_list in (False, True):
        collectives._LIST_ALLGATHER = forced_list
        out = torch.zeros(world * 3)
        own = out.view(world, 3)[rank]
        own.copy_(torch.arange(3) + 10 * rank)
        collectives.all_gather_into(out, own)
        later = torch.zeros(world * 3)
        collectives.all_gather_into(later, torch.arange(3.0) + 10 * rank, async_op=True).wait()
        results.append((out.tolist(), later.tolist()))
    collectives._LIST_ALLGATHER = False
    return results


def test_all_gather_into_is_rank_major_with_and_without_the_fallback():
    for tensor_form, list_form in run_ranks(2, _gather_both_ways):
        want = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert tensor_form == list_form == (want, want)
