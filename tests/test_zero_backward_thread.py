"""On a GPU, autograd runs backward on its own device thread, not the thread that ran forward; zero_ext's
ZeRO-3 backward hooks (pre_backward's gathers, post_backward's release and reduce-scatter) then run there.
Their per-thread state (zero/internal.py's section, the guard on partitioned parameters) must hold on that
thread. On CPU autograd runs backward on the calling thread, so calling backward from another thread
puts the hooks on a thread other than forward's, as a GPU does: training must give the same bits as
when everything runs on the main thread."""
import threading

import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _train(backward_on_thread: bool):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    errors = []
    for _ in range(3):
        loss = engine(MLP.batch(4, gen)[0]).pow(2).mean()
        if backward_on_thread:
            def run():
                try:
                    engine.backward(loss)
                except BaseException as e:  # reported on the main thread below
                    errors.append(repr(e))
            t = threading.Thread(target=run)
            t.start()
            t.join()
        else:
            engine.backward(loss)
        engine.step()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params, errors


def test_backward_on_another_thread_gives_the_same_training():
    main = run_ranks(2, _train, False)
    threaded = run_ranks(2, _train, True)
    for (want, _), (got, errors) in zip(main, threaded):
        assert errors == []
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
