"""The state machines of the ZeRO-3 parameter layer, as enums (a leaf: imports nothing of zero_ext).

See docs/zero3.md, "State machines".
"""
from enum import Enum


class ZeroParamStatus(Enum):
    """Where a partitioned parameter's full value is (DeepSpeed's names and values, which third-party
    code such as HF Transformers and PEFT compares against; keep them).

    - ``NOT_AVAILABLE``: partitioned. ``param.data`` is an empty tensor (shape ``[0]``); the rank's piece
      is ``param.ds_tensor``; the full storage is freed.
    - ``INFLIGHT``: an all-gather into the full storage has been issued and not yet completed.
    - ``AVAILABLE``: gathered. ``param.data`` is the full tensor (shape ``ds_shape``).

    Transitions: ``NOT_AVAILABLE -> INFLIGHT -> AVAILABLE -> NOT_AVAILABLE``, made only by
    :class:`zero_ext.zero.param.ZeroParam` (``to_inflight``, ``to_gathered``, ``to_partitioned``).
    """

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class TrainingPhase(Enum):
    """The phase of one call of a module's forward (a :class:`zero_ext.zero.hooks.ModuleCall`), which
    decides what the call holds gathered. FSDP2's ``TrainingState``, per call rather than per module so
    that a module run twice in one forward (or recomputed under activation checkpointing) keeps each
    call's fetch and release paired.

    ``IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> IDLE`` (the last step from the post-backward hook or
    from the end-of-backward callback, whichever comes first).
    """

    IDLE = 1  # holds nothing
    FORWARD = 2  # between the forward pre-hook and post-hook: holds the module's parameters
    PRE_BACKWARD = 3  # gradient reached an output: holds the parameters for the module's backward


class FetchKind(Enum):
    """Why parameters are being gathered; part of the fingerprint ranks compare before each gather
    (see [Note: fetch-order agreement] in fetch.py)."""

    FORWARD = 1  # a module's forward pre-hook
    BACKWARD = 2  # a module's pre-backward hook
    EXTERNAL = 3  # a parameter used in the forward of a module that does not own it
    GATHERED = 4  # GatheredParameters
    PERSIST = 5  # persistent parameters, gathered once when the hooks are installed
    PARTITION = 6  # whole parameters about to be cut into pieces (zero.Init, partition_module)
    PREFETCH = 7  # gathers issued ahead of the modules that will use them (coordinator.py)
    CHECKPOINT = 8  # no gather: ranks confirm the trace events they consumed without one (coordinator.py)
    TRACE = 9  # no gather: ranks compare the trace each recorded (coordinator.py)
    INIT = 10  # under zero.Init, a torch call reached a partitioned parameter (materialise.py)
    REDUCE = 11  # no gather: a bucket of gradients about to be reduced (optim/step_check.py)
    STEP = 12  # no gather: the optimizer step at an accumulation boundary (optim/step_check.py)
    RESIDENT = 13  # no gather: ranks compare what their resident decoding forwards did (resident.py)
    STREAM = 14  # the stamp a streaming decoding forward's gather carries instead of a row (streaming.py)


class TraceState(Enum):
    """Where the prefetch coordinator (coordinator.py) stands with the fetch order it records.

    ``RECORD -> COMPLETE`` at the start of the step after the recording (once every rank recorded the
    same trace); ``COMPLETE -> INVALID`` when a fetch differs from the trace (or a step ends before
    it); ``INVALID -> RECORD`` at the start of the next step. Only ``COMPLETE`` prefetches and keeps
    parameters for reuse; the other two fetch on demand, as without a coordinator.
    """

    RECORD = 1  # this step's fetches are being recorded
    COMPLETE = 2  # the trace is known: fetches are checked against it, prefetched and kept for reuse
    INVALID = 3  # this step left the trace: on demand until the step ends, then record again
