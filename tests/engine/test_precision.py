"""PrecisionOptimizer in one process: masters only for active groups, policies, fp16 loss scaling, checkpoints."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from hf_altparams import AltParamsError, ParamGroups, PlanError, PrecisionOptimizer
from hf_altparams.engine import PhaseSwitcher
from hf_altparams.plan import Alternating

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


GROUPS = {"a": "0.*", "b": "2.*", "c": "4.*"}


def _train(
    policy: str, steps: int = 8, dtype: torch.dtype = torch.bfloat16, **kw: object
) -> tuple[nn.Module, PrecisionOptimizer]:
    model = _model()
    groups = ParamGroups(model, GROUPS)
    opt = PrecisionOptimizer(groups, ADAMW, storage_dtype=dtype, master_policy=policy, **kw)  # type: ignore[arg-type]
    switcher = PhaseSwitcher(groups, Alternating(["a", "b", "c"], every=2), optimizer=opt)
    for step in range(steps):
        switcher.step_to(step)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.scale_loss(model(x).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_parameters_are_stored_low_precision_with_fp32_masters_and_state_for_active_groups_only() -> None:
    model, opt = _train("drop", steps=3)  # phase "b" at step 3
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    active = sum(p.numel() for p in model[2].parameters())
    assert opt.master_bytes() == {"cpu": 4 * active}
    for tensor in opt.inner["b"].state[model[2].weight].values():
        if tensor.is_floating_point() and tensor.dim() > 0:
            assert tensor.dtype == torch.float32


def test_offload_equals_keep_and_drop_rounds_on_reentry() -> None:
    kept, _ = _train("keep", steps=9)
    offloaded, _ = _train("offload", steps=9)
    dropped, _ = _train("drop", steps=9)
    for k, o in zip(kept.parameters(), offloaded.parameters()):
        assert torch.equal(k, o)
    # group "a" re-entered at step 6 from its rounded weights: it may differ, by a few bf16 ulps at most
    diffs = [(k.float() - d.float()).abs().max().item() for k, d in zip(kept.parameters(), dropped.parameters())]
    assert max(diffs) < 0.05


def test_bf16_storage_with_masters_beats_bf16_updates_without_them() -> None:
    """Small updates vanish when written straight into bf16; the master keeps them."""
    param = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    holder = nn.Module()
    holder.w = param
    opt = PrecisionOptimizer(ParamGroups(holder, {"w": "w"}), functools.partial(torch.optim.SGD, lr=1e-4))
    naive = torch.ones(64, dtype=torch.bfloat16)
    for _ in range(100):
        param.grad = torch.ones_like(param)
        opt.step()
        naive -= 1e-4  # bf16 ulp at 1.0 is 2**-7: every update rounds away
    assert torch.equal(naive, torch.ones(64, dtype=torch.bfloat16))
    assert param.float().mean().item() == pytest.approx(0.99, abs=2**-8)


def test_fp16_dynamic_loss_scale_skips_non_finite_steps() -> None:
    model, opt = _train("offload", steps=6, dtype=torch.float16, loss_scale="dynamic")
    assert opt.loss_scale is not None
    skipped = opt.skipped_steps  # 2**16 overflows fp16 here at first: the scale halves until it fits
    assert skipped < 6 and opt.loss_scale.scale == 2.0 ** (16 - skipped)
    before = copy.deepcopy(model.state_dict())
    scale = opt.loss_scale.scale
    model[4].weight.grad = torch.full_like(model[4].weight, float("inf"))  # group "c" is active
    with pytest.raises(AltParamsError, match="scale_loss"):
        opt.step()  # gradients of an unscaled loss would be divided by the scale
    opt.scale_loss(torch.zeros(()))
    opt.step()
    assert opt.skipped_steps == skipped + 1 and opt.loss_scale.scale == scale / 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_state_dict_round_trip_restores_masters_and_fp32_state_exactly() -> None:
    model, opt = _train("offload", steps=5)
    saved = copy.deepcopy(opt.state_dict())
    fresh = _model()
    fresh.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt2 = PrecisionOptimizer(ParamGroups(fresh, GROUPS), ADAMW, master_policy="offload", active=opt.active)
    opt2.load_state_dict(saved)
    assert opt2.master_bytes() == opt.master_bytes()
    for name in GROUPS:
        for pname, master in opt.masters[name].items():
            assert torch.equal(opt2.masters[name][pname], master)
    again = opt2.state_dict()
    for name in GROUPS:
        for pname, state in saved["groups"][name]["state"].items():
            for key, value in state.items():
                assert torch.equal(again["groups"][name]["state"][pname][key], value), (name, pname, key)
                assert again["groups"][name]["state"][pname][key].dtype == value.dtype


def test_bad_arguments_are_refused_with_the_value_and_the_choices() -> None:
    groups = ParamGroups(_model(), GROUPS)
    with pytest.raises(
        PlanError, match=r"`master_policy` for group 'a' must be one of \['keep', 'offload', 'drop'\], got 'swap'"
    ):
        PrecisionOptimizer(groups, ADAMW, master_policy="swap")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="`storage_dtype`"):
        PrecisionOptimizer(groups, ADAMW, storage_dtype=torch.int8)
    with pytest.raises(PlanError, match="`loss_scale`"):
        PrecisionOptimizer(groups, ADAMW, loss_scale="always")
    opt = PrecisionOptimizer(groups, ADAMW)
    with pytest.raises(PlanError, match="precision"):
        opt.load_state_dict({k: v for k, v in opt.state_dict().items() if k != "precision"})
    with pytest.raises(PlanError, match="`allreduce_dtype` is torch.int8"):
        PrecisionOptimizer(groups, ADAMW, allreduce_dtype=torch.int8)


class _WithFrozenParts(nn.Module):
    """An fp32 model whose groups leave out an embedding; a BatchNorm; a parameter-less module with a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        self.scale = nn.Module()
        self.scale.register_buffer("freq", torch.full((2,), 0.5))  # computed constant: its module has no parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.body(self.emb(ids).mean(1))
        return out * self.scale.freq.to(out.dtype)


def test_the_whole_model_is_stored_in_the_storage_dtype_ungrouped_parameters_included() -> None:
    """An embedding left out of the groups used to stay fp32 and fail in the first bf16 matmul."""
    model = _WithFrozenParts()
    emb = model.emb.weight.detach().clone()
    groups = ParamGroups(model, {"lo": "body.0.*", "hi": ["body.1.*", "body.2.*"]})  # emb: ungrouped, frozen
    opt = PrecisionOptimizer(groups, ADAMW, storage_dtype=torch.bfloat16)
    assert {n: p.dtype for n, p in model.named_parameters()} == dict.fromkeys(
        ["emb.weight", "body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias", "body.2.weight", "body.2.bias"],
        torch.bfloat16,
    )
    assert model.body[1].running_mean.dtype == torch.bfloat16  # a module's buffers follow its parameters
    assert model.scale.freq.dtype == torch.float32  # a parameter-less module's buffer keeps its dtype
    assert torch.equal(model.emb.weight.float(), emb.to(torch.bfloat16).float())  # the same values, rounded
    switcher = PhaseSwitcher(groups, Alternating(["lo", "hi"]), optimizer=opt)
    for step in range(4):
        switcher.step_to(step)
        model(torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.emb.weight.float(), emb.to(torch.bfloat16).float())  # ungrouped: frozen, never stepped
    assert set(opt.master_bytes()) == {"cpu"} and model.emb.weight.grad is None


def test_gradient_accumulation_sums_the_micro_steps_in_fp32() -> None:
    # SGD with lr=1: the master moves by exactly the gradient the step saw.
    model = nn.Sequential(nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    groups = ParamGroups(model, {"w": "0.*"})
    opt = PrecisionOptimizer(groups, functools.partial(torch.optim.SGD, lr=1.0), master_policy="keep")
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(4)]
    expected32, expected16 = torch.zeros(64, 64), torch.zeros(64, 64, dtype=torch.bfloat16)
    for x in xs:  # the micro-steps' bf16 gradients, summed in fp32 and (what fp32 avoids) in bf16
        grad = torch.autograd.grad(model(x).float().pow(2).sum(), model[0].weight)[0]
        expected32 += grad.float()
        expected16 += grad
    assert not torch.equal(expected32, expected16.float())  # the test can tell them apart
    before = model[0].weight.detach().float()  # the master is created from the stored weights
    for x in xs:
        model(x).float().pow(2).sum().backward()
    assert torch.equal(model[0].weight.grad, expected32.to(torch.bfloat16))  # the sum, rounded, for readers
    opt.step()
    assert model[0].weight.grad is None
    torch.testing.assert_close(before - opt.masters["w"]["0.weight"], expected32, rtol=0, atol=0)


def test_a_gradient_clipped_after_accumulation_is_what_the_step_uses() -> None:
    model = nn.Sequential(nn.Linear(16, 16, bias=False)).to(torch.bfloat16)
    opt = PrecisionOptimizer(ParamGroups(model, {"w": "0.*"}), functools.partial(torch.optim.SGD, lr=1.0))
    before = model[0].weight.detach().float()
    for i in range(3):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    assert norm > 0.5  # it did clip
    clipped = model[0].weight.grad.float()
    opt.step()
    torch.testing.assert_close(before - opt.masters["w"]["0.weight"], clipped, rtol=0, atol=0)


def test_accumulated_sums_are_cleared_by_zero_grad_and_not_saved_mid_window() -> None:
    model = _model(torch.bfloat16)
    opt = PrecisionOptimizer(ParamGroups(model, GROUPS), ADAMW)
    x = torch.randn(5, 4).to(torch.bfloat16)
    model(x).sum().backward()
    model(x).sum().backward()  # second micro-step: the first one's gradients now wait in fp32
    model(x)  # the forward of a third micro-step moves the second one's as well
    with pytest.raises(AltParamsError, match="gradient-accumulation window"):
        opt.state_dict()
    opt.zero_grad()
    assert opt._grads32.pending() == 0
    opt.state_dict()  # at a step boundary: fine


@pytest.mark.cuda
def test_cuda_idle_masters_go_to_pinned_host_memory_and_the_run_equals_keep() -> None:
    def run(policy: str) -> tuple[nn.Module, PrecisionOptimizer, list[dict[str, int]]]:
        model = _model().cuda()
        groups = ParamGroups(model, GROUPS)
        opt = PrecisionOptimizer(groups, ADAMW, master_policy=policy)  # type: ignore[arg-type]
        switcher = PhaseSwitcher(groups, Alternating(["a", "b", "c"], every=2), optimizer=opt)
        where = []
        for step in range(9):
            switcher.step_to(step)
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).to("cuda", torch.bfloat16)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            where.append(opt.master_bytes())
        return model, opt, where

    kept, _, _ = run("keep")
    offloaded, opt, where = run("offload")
    # step 8 trains "b" (every=2: a a b b c c a a b); "a" and "c" are idle, their masters pinned on the host
    assert all(m.is_pinned() for masters in (opt.masters["a"], opt.masters["c"]) for m in masters.values())
    assert where[-1]["cuda"] == 4 * sum(p.numel() for p in offloaded[2].parameters())
    for k, o in zip(kept.parameters(), offloaded.parameters()):
        assert torch.equal(k, o)


def test_ddp_attach_shares_one_counting_hook_and_refuses_an_fp32_wire_beside_another_hook(gloo_world_1: object) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_altparams import SwitchError, register_comm_counter

    def wrapped(**kw: object) -> tuple[nn.Module, DDP, PrecisionOptimizer, PhaseSwitcher]:
        model = _model(torch.bfloat16)
        groups = ParamGroups(model, GROUPS)
        opt = PrecisionOptimizer(groups, ADAMW, **kw)  # type: ignore[arg-type]
        switcher = PhaseSwitcher(groups, Alternating(["a", "b", "c"]), optimizer=opt)
        switcher.step_to(0)
        return model, DDP(model), opt, switcher

    model, ddp, opt, switcher = wrapped(allreduce_dtype=torch.float32)
    switcher.attach(ddp)
    counter = register_comm_counter(ddp)  # count_comm after attach: the same hook, not a second one
    assert counter.dtype == torch.float32 and len(ddp._comm_hooks) == 1
    x = torch.randn(5, 4).to(torch.bfloat16)
    for _ in range(2):  # accumulation 2: the first micro-step without sync
        with ddp.no_sync():
            ddp(x).sum().backward()
        ddp(x).sum().backward()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt.step()
        opt.zero_grad()
        assert counter.end_step() == 4 * trainable  # bf16 gradients, all-reduced in fp32
    del ddp, switcher

    _, ddp, opt, switcher = wrapped(allreduce_dtype=torch.float32)
    ddp.register_comm_hook(dist.group.WORLD, fp16_compress_hook)
    with pytest.raises(SwitchError, match="allreduce_dtype=torch.float32.*has one already"):
        switcher.attach(ddp)
    _, ddp, opt, switcher = wrapped()  # default wire dtype: DDP's own all-reduce, or the user's hook
    ddp.register_comm_hook(dist.group.WORLD, fp16_compress_hook)
    switcher.attach(ddp)
    assert len(ddp._comm_hooks) == 1


@pytest.mark.parametrize(
    "storage, policy", [(torch.bfloat16, "offload"), (torch.bfloat16, "drop"), (torch.float32, "drop")]
)
def test_planner_equals_the_model_state_measured_on_the_rank(
    gloo_world_1: object, storage: torch.dtype, policy: str
) -> None:
    """plan_cost's peak (device + host: one RAM on CPU) against the storages counted after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hf_altparams.engine import CommCounter, GroupedOptimizer
    from hf_altparams.engine.comm import counting_allreduce_hook
    from hf_altparams.planner import plan_cost
    from tests.support.meters import ModelStateMeter, total_state

    model = _model(storage)
    groups = ParamGroups(model, GROUPS)
    schedule = Alternating(["a", "b", "c"], every=2)
    if storage == torch.float32:
        opt: GroupedOptimizer = GroupedOptimizer(groups, ADAMW, state_policy=policy)
    else:
        opt = PrecisionOptimizer(groups, ADAMW, master_policy=policy, state_policy=policy)  # type: ignore[arg-type]
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)
    meter = ModelStateMeter(model, opt)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: DDP checks real types
        meter.note_bucket(bucket.buffer())
        return counting_allreduce_hook(state, bucket)

    ddp.register_comm_hook(CommCounter(), hook)
    handle = register_optimizer_step_post_hook(lambda *_: meter.sample())
    try:
        for step in range(8):
            ddp(torch.randn(5, 4).to(storage)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            meter.forget_buckets()
            switcher.step_to(step + 1)
    finally:
        handle.remove()
    plan = plan_cost(
        model,
        groups,
        schedule,
        state_policy=policy,
        world_size=1,
        steps=8,
        storage_dtype=None if storage == torch.float32 else storage,
        master_policy=policy,
    )
    assert total_state(meter.peak) == max(r.device_bytes + r.host_bytes for r in plan.phases) > 0
