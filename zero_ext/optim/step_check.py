"""Ranks confirm they are at the same point of the training step before the engine's own collectives.

A rank that skips a module (a rank-dependent branch: at stage 3 one whose parameters are persistent
escapes the fetch-order check, at stages 0-2 there is none), leaves a loss term out, or runs one more
step than the others reaches the gradient reductions with other buckets, or none. On the native
transport mismatched collectives do not fail (they exchange bytes of another op: wrong results or a
wait until the timeout); on gloo they abort a rank (``op.preamble.length <= op.nbytes``). So before
each bucket of gradients is reduced, and before the optimizer step at an accumulation boundary, the
ranks exchange one fixed-size row in the format of ZeRO-3's fetch-order agreement ([Note: fetch-order
agreement], zero/fetch.py): what (a reduction: which parameters, how many elements; a step: its
number), so that every rank raises the same FetchOrderError naming what each rank was about to do,
whatever agreement (a gather's, a reduction's, a step's) the other ranks are in.

Cost: one all-gather of 48 * world bytes per bucket and per boundary step (bench: docs/debugging.md).
"""
from typing import Callable, Optional, Sequence

import torch

from ..zero import collectives
from ..zero.fetch import FetchSite, check_agreement
from ..zero.status import FetchKind


def agree_on_reduction(indices: Sequence[int], numels: Sequence[int], group, device: torch.device,
                       first_ds_id: int = -1, namer: Optional[Callable[[int], str]] = None) -> None:
    """Before reducing one bucket: every rank's bucket holds the same parameters (``indices``: their
    positions in the optimizer, the same on every rank; ``first_ds_id``: stage 3's, to name it)."""
    site = FetchSite(FetchKind.REDUCE, indices[0] if first_ds_id < 0 else -1, "", namer)
    check_agreement(site, [torch.Size([n]) for n in numels], first_ds_id, group,
                    collectives.check_device(group, device), stamp=indices)


def agree_on_step(step: int, group, device: torch.device) -> None:
    """Before the optimizer step at a boundary: every rank is about to take step number ``step``."""
    check_agreement(FetchSite(FetchKind.STEP, step), [], -1, group, collectives.check_device(group, device))
