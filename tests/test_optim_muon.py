"""The Muon optimizer ("type": "Muon") at ZeRO stages 0-3 against a plain single-process Muon written here.

Which parameters Muon steps (DeepSpeed's rule): two or more dimensions and no "embed"/"lm_head" in the
name; the rest step the auxiliary Adam. The reference keeps whole tensors and whole momentum buffers,
runs the standard Newton-Schulz iteration, and averages the ranks' gradients in fp32.

Tolerances: fp32, 1 rank: bit-exact for ns_method "standard" (the same operations on the same values);
2 ranks: |dp| <= 1e-5 (|p| + lr) (gradients averaged in another order; Newton-Schulz is smooth); "gram" vs
the standard reference: the same iteration rearranged, equal within 1e-4 (|p| + lr) after the steps."""
import pytest
import torch
from torch import nn

from helpers.engine import full_params
from helpers.harness import run_ranks

LR, STEPS, WD = 2e-2, 4, 0.01


class MuonNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)  # 2-D, but an embedding: Adam
        self.mix = nn.Parameter(torch.randn(2, 8, 8) * 0.3)  # 3-D: Muon, a batch of two matrices
        self.body = nn.Linear(8, 13)  # weight: Muon (tall: 13 x 8); bias: Adam
        self.lm_head = nn.Linear(13, 20)  # the output head: Adam

    def forward(self, tokens):
        h = self.embed(tokens)
        h = torch.tanh(torch.einsum("btd,kde->bte", h, self.mix))
        return self.lm_head(torch.tanh(self.body(h)))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))


def _batches(world):
    gen = torch.Generator().manual_seed(7)
    return [[torch.randint(0, 20, (2, 6), generator=gen) for _ in range(world)] for _ in range(STEPS)]


# -- the reference ------------------------------------------------------------------------------------------

def _ns_standard(g):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def _reference(world):
    torch.manual_seed(0)
    model = MuonNet()
    muon = {n for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n}
    state = {n: {} for n, _ in model.named_parameters()}
    for t, step in enumerate(_batches(world), start=1):
        model.zero_grad()
        (sum(model.loss(b) for b in step) / world).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                g, s = p.grad, state[n]
                if n in muon:
                    m = s.setdefault("m", torch.zeros_like(p))
                    m.lerp_(g, 1 - 0.95)
                    u = _ns_standard(g.lerp(m, 0.95)) * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
                else:
                    m, v = s.setdefault("m", torch.zeros_like(p)), s.setdefault("v", torch.zeros_like(p))
                    m.lerp_(g, 1 - 0.9)
                    v.lerp_(g.square(), 1 - 0.95)
                    u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-10)
                p.mul_(1 - LR * WD)
                p.add_(u, alpha=-LR)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, muon


# -- the engine ---------------------------------------------------------------------------------------------

def _engine_run(stage, ns_method, **extra):
    import zero_ext

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MuonNet()
    zero = {"stage": stage, "reduce_bucket_size": 64, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": zero,
              "optimizer": {"type": "Muon", "params": {"lr": LR, "weight_decay": WD, "ns_method": ns_method}},
              **extra}
    engine, opt, *_ = zero_ext.initialize(model=model, config=config)
    for step in _batches(world):
        engine.backward(engine.module.loss(step[rank]))
        engine.step()
    flags = {n: p.use_muon for n, p in model.named_parameters()}
    return full_params(engine), flags, [g["name"] for g in opt.param_groups]


def _close(got, want, tol):
    return all(((got[n] - want[n]).abs() <= tol * (want[n].abs() + LR)).all() for n in want)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_standard_is_bit_exact_with_the_reference(stage):
    got, flags, groups = run_ranks(1, _engine_run, stage, "standard")[0]
    want, muon = _reference(1)
    assert {n for n, f in flags.items() if f} == muon == {"mix", "body.weight"}
    assert groups == ["muon-params", "adam-params"]
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_match_the_reference(stage):
    got, _, _ = run_ranks(2, _engine_run, stage, "standard")[0]
    assert _close(got, _reference(2)[0], 1e-5)


def test_gram_newton_schulz_is_the_same_iteration():
    from zero_ext.optim.muon import newton_schulz

    gen = torch.Generator().manual_seed(1)
    for shape in [(8, 30), (30, 8), (3, 5, 11), (12, 12)]:
        g = torch.randn(*shape, generator=gen)
        assert torch.allclose(newton_schulz(g, method="gram"), _ns_standard(g), atol=2e-4)
        assert torch.equal(newton_schulz(g, method="standard"), _ns_standard(g))
    got, _, _ = run_ranks(2, _engine_run, 2, "gram")[0]
    assert _close(got, _reference(2)[0], 1e-4)


def test_fp16_with_a_static_loss_scale_of_one_trains_like_the_reference():
    # nothing is scaled, so there is no loss scale for the update to be divided by: accepted (as DeepSpeed
    # does); fp16 parameters round each step, hence the looser bound
    got, _, _ = run_ranks(2, _engine_run, 2, "standard", fp16={"enabled": True, "loss_scale": 1.0})[0]
    assert _close(got, _reference(2)[0], 5e-3)


def test_muon_config_is_checked():
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="ns_method"):
        load_config({"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}})
    with pytest.raises(ConfigError, match="fp16"):
        load_config({"optimizer": {"type": "Muon"}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp16"):
        load_config({"optimizer": {"type": "Muon"}, "fp16": {"enabled": True, "loss_scale": 128}})
    assert load_config({"optimizer": {"type": "Muon"}, "fp16": {"enabled": True, "loss_scale": 1}}).fp16.enabled
    cfg = load_config({"optimizer": {"type": "muon", "params": {"muon_lr": 0.05, "adam_lr": 1e-3}}})
    assert cfg.optimizer.type == "muon"


def test_groups_take_muon_lr_and_adam_lr_over_lr():
    from zero_ext.optim.muon import muon_param_groups

    model = MuonNet()
    groups = muon_param_groups(model, [{"params": list(model.parameters())}],
                               {"lr": 0.1, "muon_lr": 0.05, "momentum": 0.9, "betas": [0.8, 0.9]})
    muon, adam = groups
    assert (muon["lr"], muon["momentum"], muon["ns_method"], len(muon["params"])) == (0.05, 0.9, "gram", 2)
    assert (adam["lr"], adam["betas"], adam["eps"], len(adam["params"])) == (0.1, (0.8, 0.9), 1e-10, 4)


def _resume(stage, tmp, phase, offload):
    """Trains STEPS steps of the 2-rank batches (1 rank: as 2 accumulated micro steps); "save"
    checkpoints after 2, "load" starts from that checkpoint (the momentum buffers and Adam state come
    from it) and trains the rest."""
    import zero_ext

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
            **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": zero,
              "gradient_accumulation_steps": 2 // world, "optimizer": {"type": "Muon", "params": {"lr": LR}}}
    engine, *_ = zero_ext.initialize(model=MuonNet(), config=config)
    if phase == "load":
        engine.load_checkpoint(tmp, tag="t")
    for i, step in enumerate(_batches(2)):
        if phase == "save" and i == 2:
            engine.save_checkpoint(tmp, tag="t")
        if phase == "load" and i < 2:
            continue
        for micro in ([step[rank]] if world == 2 else step):
            engine.backward(engine.module.loss(micro))
            engine.step()
    return full_params(engine)


@pytest.mark.parametrize("stage, offload", [(1, True), (2, False), (3, False)])
def test_checkpoint_resume_carries_the_momentum(tmp_path, stage, offload):
    straight = run_ranks(2, _resume, stage, str(tmp_path), "save", offload)[0]
    resumed = run_ranks(2, _resume, stage, str(tmp_path), "load", offload)[0]
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)


def test_checkpoint_reshards_the_muon_state_to_another_world_size(tmp_path):
    # saved by 2 ranks (momentum partitioned in 2), resumed by 1 accumulating the same two micro batches
    straight = run_ranks(2, _resume, 2, str(tmp_path), "save", False)[0]
    resumed = run_ranks(1, _resume, 2, str(tmp_path), "load", False)[0]
    assert _close(resumed, straight, 1e-5)
