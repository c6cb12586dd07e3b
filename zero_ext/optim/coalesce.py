"""``engine.coalesce_grad_reduction()`` (DeepSpeed's API): several backward passes, one gradient reduction.

Inside the block each backward leaves its gradients on this rank; when the block ends they are reduced
once, as if they had come from a single backward, and the ``engine.step()`` after the block applies them.
Stages 2 and 3 normally reduce bucket by bucket during every backward: here their reducers defer
(``BucketReducer`` / ``ShardReducer``: ``begin_deferral`` / ``end_deferral``), so N backward passes cost
one reduction instead of N, at the price of one full-size gradient per parameter held until the block
ends (stage 2: in ``param.grad``, where autograd sums them; stage 3: beside the partitioned parameter).
Stages 0 and 1 reduce only at the accumulation boundary anyway: for them the block changes nothing.

Rules (as DeepSpeed's): ``engine.step()`` inside the block raises; it does not nest with itself or with
``engine.no_sync()``; one block is one optimizer step. Where we differ: the ``safe_get_*`` gradient
routines raise inside the block (the averaged gradient does not exist yet; DeepSpeed returns the local,
unaveraged one), an exception inside the block drops the deferred gradients instead of reducing them
(a rank that raised would leave the others waiting in the reduction), and stage 0 and bf16 with
``grad_accum_dtype: fp32`` are accepted (DeepSpeed refuses them: its optimizers for those cases lack
the hooks it defers).
"""
import contextlib

from ..config.errors import EngineUsageError


def check_coalesce(engine, inside: str) -> None:
    """Raises if the block cannot start; ``inside``: the no_sync-like block the engine is in, or None."""
    if getattr(engine, "pipeline_parallelism", False):
        raise NotImplementedError("engine.coalesce_grad_reduction() is not supported under pipeline parallelism")
    if not engine.managed_gradient_accumulation():
        raise EngineUsageError("engine.coalesce_grad_reduction() needs managed_gradient_accumulation (the default): "
                               "without it the caller's step() already owns the accumulation boundary")
    if inside:
        raise EngineUsageError(f"engine.coalesce_grad_reduction() cannot be nested inside engine.{inside}(): "
                               "leave that block first (each block is one optimizer step)")


@contextlib.contextmanager
def deferred_reduction(reducer):
    """The reducer keeps each backward's gradients until the block ends, then reduces them once; if the
    block raises, they are dropped."""
    reducer.begin_deferral()
    try:
        yield
    except BaseException:
        reducer.end_deferral(flush=False)
        raise
    reducer.end_deferral(flush=True)
