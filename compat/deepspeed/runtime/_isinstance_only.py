"""DeepSpeed's optimizer classes that zero_ext never builds, kept for ``isinstance`` checks.

zero_ext has one optimizer class, ZeroOptimizer, for every stage and precision; DeepSpeed has one per
case (DeepSpeedZeroOptimizer, its Stage3 sibling, BF16_Optimizer, FP16_Optimizer, ...). Libraries and
tests ask ``isinstance(opt, DeepSpeedClass)``: each such class answers from a predicate on zero_ext's
optimizer, and refuses to be built."""


def isinstance_only(name: str, module: str, doc: str, matches, refusal: str):
    """A class named ``name`` (in ``module``) whose instances are the objects ``matches(obj)`` accepts;
    building one raises TypeError(``refusal``)."""

    class _Check(type):
        def __instancecheck__(cls, obj):
            return bool(matches(obj))

    def __init__(self, *args, **kwargs):
        raise TypeError(refusal)

    return _Check(name, (), {"__init__": __init__, "__doc__": doc, "__module__": module})
