"""Fetch and release: the two operations every user of partitioned parameters goes through.

``fetch(params, holder, site)`` marks the parameters held by ``holder`` and gathers those that are
partitioned, one coalesced all-gather per process group and dtype; ``release(params, holder)`` drops
the hold and partitions what nobody holds any more (persistent parameters stay). Module hooks, the
external-parameter detector, GatheredParameters and persistence all use these two and nothing else, so
the prefetch coordinator (coordinator.py) has one place to plug in: it uses ``issue`` (start the
gathers, asynchronously) and ``wait_gathered`` (finish them) to gather ahead of the modules.

[Note: fetch-order agreement]
ZeRO-3 is lock-step: every rank must gather the same parameters in the same order. A rank-dependent
branch in a model breaks that, and the all-gathers of mismatched sizes then deadlock (DeepSpeed's most
reported ZeRO-3 failure) or, worse, succeed with equal sizes and mix pieces of different parameters.
Before each gather the ranks therefore exchange a fixed-size row describing what they are about to
gather -- why (forward, backward, ...), which module (its index in the model), how many parameters,
how many elements, and a digest of their shapes -- in one small all-gather that cannot itself
mismatch. If the rows differ, every rank raises FetchOrderError naming, for each rank, the module and
first parameter it was about to gather. Partitioning (zero.Init, convert.py) runs the same check
before its scatters, so ranks that build different models get the same kind of error. The check costs
one round trip of ``48 * world`` bytes per gather (on the host when the group has gloo) and is on by
default; ``check=False`` turns it off for fetches. Along a recorded trace (coordinator.py) the same
rows run once per prefetch batch and at checkpoints, stamped with the position reached in the trace,
instead of once per gather: see [Note: checking the order along the trace].
The row leaves out ds_ids, which depend on everything a process ever built, so that two ranks whose
numbering drifted (an extra model built on one rank) are not reported as diverged.
"""
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..comm import native
from ..precision.autocast import get_allgather_dtype, get_comm_dtype
from . import collectives, internal, mics
from .param import ZeroParam, zero_param_by_ds_id
from .status import FetchKind, ZeroParamStatus

_AGREEMENTS = [0]  # agreements run by this process
_KINDS = {k.value for k in FetchKind}
_COMPARED = 5  # the first five columns of a row must agree; the sixth (a ds_id) only names a parameter
_KIND_TEXT = {FetchKind.FORWARD: "forward of", FetchKind.BACKWARD: "backward of",
              FetchKind.EXTERNAL: "a parameter used in the forward of", FetchKind.GATHERED: "GatheredParameters",
              FetchKind.PERSIST: "persistent parameters of", FetchKind.PARTITION: "partitioning (zero.Init)",
              FetchKind.PREFETCH: "prefetch (along the recorded trace) starting at",
              FetchKind.CHECKPOINT: "following the recorded trace, last fetch by", FetchKind.TRACE: "trace",
              FetchKind.INIT: "zero.Init, a torch call on the full value of partitioned parameters",
              FetchKind.REDUCE: "gradient reduction of", FetchKind.STEP: "engine.step() at the accumulation boundary",
              FetchKind.RESIDENT: "comparing the decoding forwards run with the model resident",
              FetchKind.STREAM: "decoding along the recorded trace:"}


# The fetches of the training passes, which ZeRO++ qwZ sends quantized; the others (GatheredParameters,
# persistence, partitioning, zero.Init) gather exact values, as DeepSpeed's do.
QUANTIZABLE = frozenset({FetchKind.FORWARD, FetchKind.BACKWARD, FetchKind.EXTERNAL, FetchKind.PREFETCH})
# The forward's fetches, whose release leaves ZeRO++ hpZ's node-local copy for the backward (secondary.py)
FORWARD_KINDS = frozenset({FetchKind.FORWARD, FetchKind.EXTERNAL})


class FetchOrderError(RuntimeError):
    """Ranks were about to gather different parameters (see [Note: fetch-order agreement])."""


class FetchSite(NamedTuple):
    """Why and for which module a fetch happens: labels for the profiler and the agreement row."""

    kind: FetchKind
    module_index: int = -1  # index of the module in its model (-1: none)
    module_name: str = ""
    namer: Optional[Callable[[int], str]] = None  # module index -> "name (Type)", to describe other ranks

    @property
    def label(self) -> str:
        return f"{self.kind.name.lower()} {self.module_name}".strip()


def fetch(params: Sequence[ZeroParam], holder, site: FetchSite, check: bool = True,
          stamp: Sequence[int] = ()) -> None:
    """Hold ``params`` for ``holder`` and gather the partitioned ones; returns once all of them are
    AVAILABLE (a parameter another fetch left INFLIGHT is waited for). Collective over each parameter's
    group whenever something has to be gathered: every rank must call it at the same point. ``stamp``:
    extra ints the ranks must agree on (the coordinator's trace position)."""
    for zp in params:
        zp.hold(holder)
    issue(params, site, check, stamp)
    wait_gathered(params)


def issue(params: Sequence[ZeroParam], site: FetchSite, check: bool = True, stamp: Sequence[int] = (),
          carried=None) -> int:
    """Start gathering the partitioned ones among ``params`` (one asynchronous coalesced all-gather per
    process group, device and dtype, each after its fetch-order agreement when ``check``); they are
    INFLIGHT until ``wait_gathered``. Holds nothing. Returns the number of elements issued.
    ``carried``: a streaming.Carrier, whose stamp the gathers carry instead of an agreement row (see
    [Note: streaming decoding] in streaming.py)."""
    need = [zp for zp in params if zp.status is ZeroParamStatus.NOT_AVAILABLE]
    issued = 0
    training = site.kind in QUANTIZABLE
    for (group, _, _, quantized, secondary, by_all_reduce), bucket in _buckets(need, training).items():
        with internal.section():
            if check:
                _agree(bucket, site, group, stamp)
            with internal.labelled(f"zero_ext::all_gather ({site.label})"):
                outputs = [zp.to_inflight() for zp in bucket]
                if carried is not None:  # streaming decoding: the check rides in the gather
                    pending = carried.gather_async(bucket, outputs)
                elif secondary:  # hpZ: within the node, from the copies kept at the forward's release
                    pending = bucket[0].secondary.gather_async(bucket, outputs)
                else:
                    pending = _gather_async(bucket, outputs, group, quantized, by_all_reduce)
                    if site.kind in FORWARD_KINDS and bucket[0].secondary is not None:
                        bucket[0].secondary.gathered_for_training(bucket)  # hpZ: copy kept at release
                gather = _Gather(pending, bucket)
                for zp in bucket:
                    zp.await_gather(gather)
                    issued += zp.numel
    return issued


def _gather_async(bucket: List[ZeroParam], outputs: List[torch.Tensor], group, quantized: bool,
                  by_all_reduce: bool = False):
    """The all-gather of ``bucket``'s pieces over their group: flat, as an all-reduce of zero-filled
    blocks (stage3_use_all_reduce_for_fetch_params), or in two levels for a MiCS shard group spanning
    nodes with mics_hierarchical_params_gather (zero/mics.py). A bucket of torch_autocast parameters
    travels in their comm_dtype: the pieces cast down, the gathered values copied back into the
    parameters' own dtype (DeepSpeed's get_allgather_dtype)."""
    pieces, numels = [zp.read_piece() for zp in bucket], [zp.numel for zp in bucket]
    dtype = get_allgather_dtype(bucket[0].param, pieces[0])
    if dtype != outputs[0].dtype and not quantized:
        own = outputs
        pieces = [p.to(dtype) for p in pieces]
        outputs = [torch.empty(o.shape, dtype=dtype, device=o.device) for o in own]
        inner = _gather_pieces(pieces, outputs, numels, group, quantized, by_all_reduce)
        return collectives.PendingGather(inner, lambda: [o.copy_(t) for o, t in zip(own, outputs)])
    return _gather_pieces(pieces, outputs, numels, group, quantized, by_all_reduce)


def _gather_pieces(pieces, outputs, numels, group, quantized: bool, by_all_reduce: bool):
    layout = mics.of(group)
    if layout is not None and layout.hierarchy is not None and not (quantized or by_all_reduce):
        intra, inter, per_node = layout.hierarchy
        return collectives.all_gather_two_level_async(pieces, outputs, numels, intra, inter, per_node)
    return collectives.all_gather_pieces_async(pieces, outputs, numels, group, quantized, by_all_reduce)


def wait_gathered(params: Sequence[ZeroParam]) -> None:
    """Wait for those of ``params`` still INFLIGHT; afterwards each is AVAILABLE (or was partitioned)."""
    for zp in params:
        if zp.status is ZeroParamStatus.INFLIGHT:
            with internal.section(), internal.labelled("zero_ext::wait_gather"):
                zp.pending_gather.wait()


class _Gather:
    """One issued all-gather and the parameters it fills: waiting makes all of them AVAILABLE."""

    __slots__ = ("pending", "params")

    def __init__(self, pending: collectives.PendingGather, params: List[ZeroParam]):
        self.pending, self.params = pending, params

    def wait(self) -> None:
        self.pending.wait()
        params, self.params = self.params, []
        for zp in params:
            zp.to_gathered()


def release(params: Sequence[ZeroParam], holder) -> None:
    """Drop ``holder``'s hold; partition each parameter nobody holds (unless persistent). Local: no
    communication (a parameter still INFLIGHT is waited for first: its gather was issued everywhere)."""
    with internal.section():
        for zp in params:
            if zp.unhold(holder) and not zp.persist:
                if zp.status is ZeroParamStatus.INFLIGHT:
                    zp.pending_gather.wait()
                if zp.status is ZeroParamStatus.AVAILABLE:
                    if zp.secondary is not None:
                        zp.secondary.keep(zp)
                    zp.to_partitioned()


def _buckets(params: Sequence[ZeroParam], training: bool) -> Dict[Tuple, List[ZeroParam]]:
    """What one all-gather can carry: same process group, compute device, dtype and, for a fetch of the
    training passes, whether it is quantized (qwZ) or served by the node's secondary copies (hpZ; never
    quantized: the copies hold the values gathered before), and whether it runs as an all-reduce
    (stage3_use_all_reduce_for_fetch_params). Order kept."""
    out: Dict[Tuple, List[ZeroParam]] = {}
    for zp in params:
        secondary = training and zp.secondary is not None and zp.secondary.holds(zp)
        quantized = training and zp.quantized_gathers and not secondary
        by_all_reduce = zp.gather_by_all_reduce and not (quantized or secondary)
        dtype = (zp.dtype, get_comm_dtype(zp.param))  # (torch_autocast's gather dtype)
        out.setdefault((zp.group, zp.compute_device, dtype, quantized, secondary, by_all_reduce), []).append(zp)
    return out


def _agree(params: Sequence[ZeroParam], site: FetchSite, group, stamp: Sequence[int] = ()) -> None:
    check_agreement(site, [zp.shape for zp in params], params[0].ds_id, group,
                    collectives.check_device(group, params[0].compute_device), stamp)


def agreements() -> int:
    """How many fetch-order agreements this process has run (diagnostics, benchmarks and tests)."""
    return _AGREEMENTS[0]


def agree_rows(row: Sequence[int], group, device: torch.device, counted: bool = True) -> List[List[int]]:
    """``collectives.agree``, counted in ``agreements()`` unless not ``counted`` (for agreement rows built
    elsewhere: resident.py, the coordinator's trace comparison)."""
    _AGREEMENTS[0] += 1 if counted else 0
    return _agree_rows(row, group, device)


def check_agreement(site: FetchSite, shapes: Sequence[torch.Size], first_ds_id: int, group,
                    device: torch.device, stamp: Sequence[int] = ()) -> List[List[int]]:
    """Raise FetchOrderError on every rank unless all ranks are about to gather (or partition)
    parameters of the same shapes for the same reason and module, with the same ``stamp``; else return
    every rank's row (its ``first_ds_id`` last). Collective (one small all-gather)."""
    flat: List[int] = list(stamp) + [-2]
    for shape in shapes:
        flat.extend(shape)
        flat.append(-1)
    row = [site.kind.value, site.module_index, len(shapes), sum(torch.Size(s).numel() for s in shapes),
           collectives.digest(flat), first_ds_id]
    _AGREEMENTS[0] += 1
    rows = _agree_rows(row, group, device)
    if all(r[:_COMPARED] == rows[0][:_COMPARED] for r in rows):
        return rows
    raise_disagreement(rows, site)


def _agree_rows(row: Sequence[int], group, device: torch.device) -> List[List[int]]:
    """``collectives.agree``; a native "ranks in different collectives" failure (a rank in another
    collective of ours: a streaming forward's gather) is a FetchOrderError (see [Note: streaming
    decoding] in streaming.py)."""
    try:
        return collectives.agree(row, group, device)
    except native.CommError as exc:
        from .streaming import MISMATCH, transport_mismatch

        if MISMATCH not in str(exc):
            raise
        raise transport_mismatch(exc, group, "checking the fetch order") from exc


def describe_rows(rows: Sequence[Sequence[int]], namer) -> str:
    """One line per rank: what its agreement row (or streaming stamp) says it was doing."""
    site = FetchSite(FetchKind.STREAM, namer=namer)
    return "\n".join(f"  rank {r}: {_describe(other, site)}" for r, other in enumerate(rows))


def raise_disagreement(rows: Sequence[Sequence[int]], site: FetchSite) -> None:
    """FetchOrderError naming what each rank's agreement row says it was about to do."""
    lines = "\n".join(f"  rank {r}: {_describe(other, site)}" for r, other in enumerate(rows))
    if any(r[0] in (FetchKind.REDUCE.value, FetchKind.STEP.value) for r in rows):
        raise FetchOrderError(
            "zero_ext: the ranks are at different points of the training step (a rank-dependent branch, a "
            "module or loss term used on some ranks only, or a rank that runs one more step than the "
            "others?):\n" + lines + "\nEvery rank must run the same modules, produce gradients for the same "
            "parameters and call engine.step() as often as the others. This engine cannot continue: "
            "fix the script and start again.")
    raise FetchOrderError(
        "zero_ext ZeRO-3: the ranks are about to gather different parameters (a rank-dependent branch or "
        "a module that runs on some ranks only?):\n" + lines + "\n"
        "Every rank must build, and run, the same modules in the same order under ZeRO-3. Run every branch "
        "on every rank (and select the result), or gather the parameters on all ranks first "
        "(zero_ext.zero.GatheredParameters). This check costs one small all-gather per fetch (per "
        "prefetch batch once the fetch order is recorded); check_fetch_order=False turns it off.")


def _describe(row: Sequence[int], site: FetchSite) -> str:
    kind, module_index, count, numel, _, first = row
    try:
        what = _KIND_TEXT[FetchKind(kind)]
    except ValueError:
        what = f"fetch kind {kind} (not a zero_ext agreement row: this rank was in another collective)"
    kind = FetchKind(kind) if kind in _KINDS else None
    if kind is FetchKind.STEP:  # (the module column holds the step's number, see optim/step_check.py)
        return f"{what} of step {module_index}"
    if kind is FetchKind.STREAM:  # (count: the forward; numel and first: the batch's trace fetches)
        module = site.namer(module_index) if site.namer is not None else f"#{module_index}"
        return f"{what} streaming forward {count}, the gather for fetches {numel}-{first - 1} (from module {module})"
    if kind is FetchKind.RESIDENT:  # (count: the forwards; first: where one left the trace, see resident.py)
        return f"{what}, after {count} forward(s){'' if first < 0 else ', one of which left the trace'}"
    if kind is FetchKind.GATHERED:  # (the module column holds modifier_rank, -1 for None)
        what += f"(modifier_rank={module_index if module_index >= 0 else None})"
    elif module_index >= 0:
        named = site.namer is not None and (kind is FetchKind.REDUCE) == (site.kind is FetchKind.REDUCE)
        module = site.namer(module_index) if named else f"#{module_index}"
        what += f" {'' if kind is FetchKind.REDUCE else 'module '}{module}"
    if count == 0:  # a checkpoint row: no parameters
        return what
    zp = zero_param_by_ds_id(first) if first >= 0 else None
    name = f", first parameter {zp.name!r} (ds_id {first})" if zp is not None else (
        f", from ds_id {first}" if first >= 0 else "")
    return f"{what}: {count} parameter(s), {numel} elements{name}"
