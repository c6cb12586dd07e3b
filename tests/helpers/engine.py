"""What the engine tests read back from an engine, inside a rank (through harness.run_ranks).

Each read is collective at stage 3 (parameters gathered) or where state is partitioned: every rank calls it.
"""


def train(engine, batches, rank):
    """Runs ``batches`` (steps of micro-batches, each a list by rank) through the engine: forward on this
    rank's share, backward, step. Returns the losses as Python floats, micro-batch by micro-batch."""
    losses = []
    for step in batches:
        for micro in step:
            loss = engine.module.loss(micro[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
    return losses


def full_params(engine):
    """name -> an fp32 copy of every parameter's whole value (stage 3: gathered for the read)."""
    import zero_ext

    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def trained(engine):
    """(name, parameter) of every parameter that requires grad, in the module's order."""
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def fp32_masters(engine):
    """name -> the full fp32 master of every trained parameter (safe_get_full_fp32_param)."""
    from zero_ext.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p) for n, p in trained(engine)}


def optimizer_state(engine, key):
    """name -> the full optimizer state ``key`` (e.g. "exp_avg_sq") of every trained parameter."""
    from zero_ext.utils import safe_get_full_optimizer_state

    return {n: safe_get_full_optimizer_state(p, key) for n, p in trained(engine)}
