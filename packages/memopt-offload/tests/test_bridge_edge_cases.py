"""AdamBridge in the cases an audit found wrong: a step retried after an error, reads between
backward and step_sync, resume with overlapping clipping, frozen parameters at attach time,
double backward, a backward that raised, MultiheadAttention under overlap_forward, gradients
after the hook took one, unsupported group flags, weights written by the caller after the
optimizer was built, hooks registered after AdamBridge's. Each test fails on the code before."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from offload_testutil import (
    BOTH,
    Reference,
    assert_same_params,
    batch,
    both_updates,
    loss_of,
    make_model,
    step_pair,
)

from memopt_core.errors import ConfigError, OffloadError, StateDictError
from memopt_offload import PRECISIONS, AdamBridge


def test_a_step_refused_for_one_gradient_takes_none(device):
    """A sparse gradient refuses the step before any gradient leaves: the retry applies the
    gradients it then finds (it had applied the stale one it had taken first)."""
    a = torch.nn.Parameter(torch.zeros(4, device=device))
    emb = torch.nn.Embedding(5, 4, sparse=True).to(device)
    opt = AdamBridge([a, *emb.parameters()], lr=0.1, precision="fp32", weight_decay=0.0)
    ids = torch.tensor([1], device=device)
    (a.sum() + emb(ids).sum()).backward()  # a.grad = +1
    with pytest.raises(OffloadError, match="sparse"):
        opt.step()
    opt.zero_grad()
    emb.sparse = False
    (-a.sum() + emb(ids).sum()).backward()  # a.grad = -1
    opt.step()
    # Adam's first step is lr * g / (|g| + eps): about +lr (the stale gradient gave -lr)
    assert torch.allclose(a.detach().cpu(), torch.full((4,), 0.1))


@pytest.mark.parametrize("kind", [torch.nn.Embedding, torch.nn.EmbeddingBag])
def test_attach_hooks_refuses_a_sparse_embedding(device, kind):
    """With hooks, a sparse gradient was refused only in its own hook, after the layers whose
    gradients came first had been updated (and every step_sync() refused it again until
    zero_grad()). attach_hooks refuses the embedding, changing nothing; frozen, it is taken."""
    emb = kind(20, 8, sparse=True).to(device)
    model = torch.nn.Sequential(emb, torch.nn.Linear(8, 4).to(device))
    opt = AdamBridge(model.parameters(), lr=1e-2)
    with pytest.raises(ConfigError, match=rf"{kind.__name__} '0' has sparse=True"):
        opt.attach_hooks(model)
    assert not opt.hooks_attached
    emb.weight.requires_grad_(False)
    opt.attach_hooks(model)
    opt.detach_hooks()


def test_master_weight_waits_for_updates_started_by_the_hooks():
    w = torch.nn.Parameter(torch.zeros(4))
    model = torch.nn.Module()
    model.w = w
    opt = AdamBridge([w], lr=0.1, precision="fp32", weight_decay=0.0)
    opt.attach_hooks(model)
    update = opt._update

    def slow_update(*args):
        time.sleep(0.2)
        return update(*args)

    opt._update = slow_update
    w.sum().backward()
    assert torch.allclose(opt.master_weight(w), torch.full((4,), -0.1))  # not the zeros before
    opt.detach_hooks()


@pytest.mark.parametrize("hooks", [False, True])
def test_overlap_clipping_resumes_bit_identically(hooks):
    """clip_mode="overlap" clips with the last step's coefficient, which the state dict keeps."""

    def run(resume_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)

        def build(m):
            opt = AdamBridge(
                m.parameters(), lr=1e-2, precision="fp32", max_grad_norm=0.01, clip_mode="overlap"
            )
            if hooks:
                opt.attach_hooks(m)
            return opt

        opt = build(model)
        for s in range(4):
            if s == resume_at:
                sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                opt.detach_hooks()
                model = torch.nn.Linear(4, 4)
                model.load_state_dict(msd)
                opt = build(model)
                opt.load_state_dict(sd)
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(s)) * (1 + 10 * s)
            model(x).pow(2).mean().backward()
            opt.step_sync()
            opt.zero_grad()
        return model.weight.detach()

    assert torch.equal(run(), run(resume_at=2))


def test_attach_hooks_skips_parameters_frozen_after_construction(device):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(device)
    ref = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    ref_opt = AdamBridge(ref.parameters(), lr=1e-2, precision="fp32")
    for m in (model, ref):
        m[1].requires_grad_(False)  # the head frozen for a phase of training
    opt.attach_hooks(model)
    head = model[1].weight.detach().clone()
    x = torch.randn(3, 4, device=device)
    for _ in range(2):
        model(x).sum().backward()
        opt.step_sync()
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.equal(model[1].weight, head)
    assert_same_params(model, ref, "frozen head")
    opt.detach_hooks()
    model[0].requires_grad_(False)
    with pytest.raises(ConfigError, match="require gradients"):  # nothing left to hook
        opt.attach_hooks(model)
    assert not opt.hooks_attached  # nothing half-attached


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_double_backward_with_hooks_gives_the_bits_without():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ref = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    ref_opt = AdamBridge(ref.parameters(), lr=1e-2, precision="fp32")
    opt.attach_hooks(model)
    x = torch.randn(2, 4)
    for _ in range(2):
        model(x).pow(2).mean().backward(create_graph=True)
        opt.step_sync()
        ref(x).pow(2).mean().backward(create_graph=True)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref, "create_graph")
    opt.detach_hooks()


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("simulated failure in backward")


def test_a_backward_that_raised_does_not_stop_later_buckets_closing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    opt.attach_hooks(model)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="simulated"):
        (_Boom.apply(model[0](x)) + model[1](model[0](x))).sum().backward()
    opt.step_sync()
    opt.zero_grad()
    model(x).sum().backward()
    assert not opt._bucket.slots  # the end of backward sent the last bucket
    opt.step_sync()
    opt.detach_hooks()


def test_overlap_forward_waits_for_multihead_attention_out_proj():
    """MultiheadAttention reads its out_proj's weights without calling out_proj."""

    def build():
        torch.manual_seed(0)
        return torch.nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True
        )

    model, ref = build(), build()
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="fp32")
    ref_opt = AdamBridge(ref.parameters(), lr=1e-3, precision="fp32")
    opt.attach_hooks(model, overlap_forward=True)
    ref_opt.attach_hooks(ref)
    x = torch.randn(2, 5, 16)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step_sync()
    opt.synchronize()
    assert_same_params(model, ref, "overlap_forward")
    opt.detach_hooks()


@both_updates()
def test_a_gradient_after_the_hook_took_one_is_an_error(device, precision, update):
    """update="device" read the gradient when its bucket ran, on another thread: a backward
    inside no_update() after the step's last one was added into the update, or left in p.grad
    for the next step, depending on the race (never refused)."""
    model = torch.nn.Linear(4, 4, bias=False).to(device, torch.bfloat16)
    opt = AdamBridge(model.parameters(), lr=0.1, precision=precision, update=update)
    opt.attach_hooks(model)
    x = torch.ones(2, 4, device=device, dtype=torch.bfloat16)
    first, second = model(x).sum(), (-3 * model(x)).sum()
    first.backward()
    assert model.weight.grad is None  # taken by the hook at once
    with opt.no_update():
        second.backward()
    with pytest.raises(OffloadError, match=r"arrived twice.* until zero_grad\(\) drops it"):
        opt.step_sync()
    with pytest.raises(OffloadError, match="arrived twice"):
        opt.step_sync()  # again: the message says so
    opt.zero_grad()
    opt.step_sync()  # the first backward's step, as the message says
    before = model.weight.detach().clone()
    model(x).sum().backward()  # and training goes on
    opt.step_sync()
    assert not torch.equal(model.weight, before)


@both_updates()
def test_a_hook_registered_after_attach_hooks_sees_no_gradient(device, precision, update):
    """AdamBridge's hook takes the gradient at once: a hook registered after it sees None, and
    the bucket size changes nothing (update="host" freed gradients when their bucket left, so
    with large buckets such a hook's in-place change was applied and with small ones not)."""
    results = []
    for bucket_mb in (1e-6, 64.0):
        model = make_model(device)
        opt = AdamBridge(
            model.parameters(), lr=1e-2, precision=precision, update=update, bucket_mb=bucket_mb
        )
        opt.attach_hooks(model)
        seen = []

        def later(p, seen=seen):
            seen.append(p.grad is not None)
            if p.grad is not None:
                p.grad.mul_(0.0)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(later)
        for t in range(2):
            loss_of(model, batch(t, device)).backward()
            opt.step_sync()
        assert not any(seen), f"bucket_mb={bucket_mb}: a later hook saw a gradient"
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@both_updates()
def test_weights_written_after_the_optimizer_was_built_are_trained(device, precision, update):
    """update="host" copied each weight into its host master once, when the group was added: a
    model.load_state_dict() after building the optimizer (the usual way to load pretrained
    weights), an nn.init call or ``p.data = t`` were overwritten by the next upload. Each write
    now reaches the master (an ECC-24 master keeps its code, as memopt-ecc's weights written in
    place do; an fp32 master keeps the elements still equal to it rounded, which the write did
    not change): the same bits as the reference given the same writes."""
    model = make_model(device)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision=precision, update=update)
    model.load_state_dict(make_model(device, seed=7).state_dict())
    ref_model = copy.deepcopy(model)
    ref = Reference(ref_model, precision, lr=1e-2)
    new = torch.Generator().manual_seed(3)

    def write(how):
        p, q = model[0].weight, ref_model[0].weight
        value = torch.randn(p.shape, generator=new).to(device, p.dtype)
        with torch.no_grad():
            if how == "copy_":
                p.copy_(value)
            else:
                p.data = value.clone()
            q.copy_(value)
            m, v = ref.masters[id(q)], value.cpu()
            m.copy_(torch.where(m.to(v.dtype) == v, m, v.float()) if m.dtype != v.dtype else v)

    opt.attach_hooks(model)
    for t in range(6):
        if t == 2:
            write("copy_")
        if t == 4:
            write("data")
        loss_of(model, batch(t, device)).backward()
        loss_of(ref_model, batch(t, device)).backward()
        opt.step_sync()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")


@pytest.mark.parametrize(
    ("precision", "update"),
    [(p, "host") for p in ("fp32", "bf16", "compact", "bf16-ecc24")] + [("bf16-ecc24", "device")],
)
@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_checkpoint_after_a_weight_write_holds_the_written_weight(device, precision, update, how):
    """update="host" read a written weight into its master only when the weight's next gradient
    arrived: a state_dict() or master_weight() before it held the weight before the write, and a
    resume (or a load of that dict) put the old weight back: pretrained weights loaded and
    saved at once came back as the random init, a pruning mask was undone. They read written
    weights now: the resumed run holds the written weights and continues as the one saved."""
    model = make_model(device)
    opt = AdamBridge(
        model.parameters(), lr=1e-2, precision=precision, update=update, **BOTH[update]
    )
    for t in range(2):
        loss_of(model, batch(t, device)).backward()
        opt.step()
        opt.zero_grad()
    written = {
        n: torch.randn(p.shape, generator=torch.Generator().manual_seed(5)).to(p)
        for n, p in model.named_parameters()
    }
    with torch.no_grad():
        for n, p in model.named_parameters():
            if how == "copy_":
                p.copy_(written[n])
            else:
                p.data = written[n].clone()
    w = model[0].weight
    if PRECISIONS[precision][1] != "ecc24":  # an ECC-24 master keeps its code (test above)
        assert torch.equal(opt.master_weight(w), written["0.weight"].cpu().float())
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = make_model(device, seed=9)
    resumed_opt = AdamBridge(
        resumed.parameters(), lr=1e-2, precision=precision, update=update, **BOTH[update]
    )
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    for n, p in resumed.named_parameters():
        assert torch.equal(p, written[n]), n
    for t in range(2, 4):
        for m, o in ((model, opt), (resumed, resumed_opt)):
            loss_of(m, batch(t, device)).backward()
            o.step()
            o.zero_grad()
        assert_same_params(model, resumed, f"step {t}")
    opt.load_state_dict(saved_opt)  # a rollback to the dict in the same process
    for n, p in model.named_parameters():
        assert torch.equal(p, written[n]), n


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "compact"])
def test_a_weight_moved_with_its_values_keeps_its_master(device, precision):
    """``model.to(memory_format=...)`` or ``p.data = p.data.clone()`` after some steps moves
    each weight with its values: update="host" read every moved weight into its fp32 master,
    dropping the bits below bf16's (master differences up to 5e-4, and the run diverged).
    Only the elements that no longer equal the master rounded as the upload rounds it are
    read now: the moved run keeps the bits of the one that was not moved."""
    runs = []
    for move in (False, True):
        model = make_model(device)
        opt = AdamBridge(model.parameters(), lr=1e-2, precision=precision)
        opt.attach_hooks(model)
        for t in range(5):
            if move and t == 3:
                with torch.no_grad():
                    for p in model.parameters():
                        p.data = p.data.clone()
            loss_of(model, batch(t, device)).backward()
            opt.step_sync()
        runs.append(model)
    assert_same_params(runs[0], runs[1], precision)


@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_unsupported_group_flags_are_refused(flag):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=f"does not support {flag}=True"):
        AdamBridge([{"params": [p], flag: True}], lr=0.1, precision="fp32")
    opt = AdamBridge([p], lr=0.1, precision="fp32")
    opt.param_groups[0][flag] = True  # set later: refused at the step, not ignored
    p.grad = torch.ones(2)
    with pytest.raises(ConfigError, match=f"does not support {flag}=True"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(2))


def test_a_group_without_decoupled_weight_decay_is_refused():
    """torch's Adam groups say decoupled_weight_decay=False (L2 decay through the gradient):
    AdamBridge decayed such a group as AdamW does, silently. Refused, as maximize is."""
    p = torch.nn.Parameter(torch.zeros(2))
    match = r"does not support decoupled_weight_decay=False \(param group 0\); its weight decay"
    with pytest.raises(ConfigError, match=match):
        AdamBridge([{"params": [p], "decoupled_weight_decay": False}], precision="fp32")
    AdamBridge([{"params": [p], "decoupled_weight_decay": True}], precision="fp32")  # AdamW's
    AdamBridge([{"params": [p], "decoupled_weight_decay": None}], precision="fp32")  # unset
    with pytest.raises(ConfigError, match=r"decoupled_weight_decay .* must be True or False"):
        AdamBridge([{"params": [p], "decoupled_weight_decay": "no"}], precision="fp32")
    opt = AdamBridge([p], lr=0.1, weight_decay=0.5, precision="fp32")
    opt.param_groups[0]["decoupled_weight_decay"] = False  # set later: refused at the step
    p.grad = torch.ones(2)
    with pytest.raises(ConfigError, match=match):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(2))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda g: g.update(params=None), r"'params' of param group 0 must be the list of its"),
        (lambda g: g.pop("betas"), r"betas \(param group 0\) is missing; expected a pair"),
    ],
    ids=["params None", "betas deleted"],
)
def test_a_live_group_edited_into_nonsense_is_a_config_error(edit, match):
    """A bare TypeError (len of None) or KeyError ('betas') from the step before."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), lr=1e-2)
    edit(opt.param_groups[0])
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batch(0, "cpu")).backward()
    with pytest.raises(ConfigError, match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_live_group_replaced_by_a_non_dict_is_a_config_error():
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), lr=1e-2)
    opt.param_groups[0] = list(model.parameters())
    loss_of(model, batch(0, "cpu")).backward()
    with pytest.raises(ConfigError, match=r"param_groups\[0\] must be a dict, got a list"):
        opt.step()


@pytest.mark.parametrize(
    ("name", "value"), [("max_grad_norm", None), ("max_grad_norm", -1.0), ("clip_mode", "wait")]
)
def test_the_clipping_settings_are_fixed_at_construction(name, value):
    """They were plain attributes, read live but checked only by the constructor: None set
    between backward and step_sync() left the step's held buckets unsubmitted (the step was
    lost, then ran a step later with the next step's gradients), -1.0 reversed the updates."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), lr=1e-2, max_grad_norm=1.0, clip_mode="overlap")
    opt.attach_hooks(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batch(0, "cpu")).backward()
    with pytest.raises(
        ConfigError, match=rf"AdamBridge\.{name} is fixed at construction, got an assignment of"
    ):
        setattr(opt, name, value)
    assert (opt.max_grad_norm, opt.clip_mode) == (1.0, "overlap")
    assert opt.step_sync() > 0
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert [e["step"].item() for e in opt.state_dict()["state"].values()] == [1] * 6


def test_a_compiled_caller_runs_the_step_eagerly():
    """torch.compile around step() (a compiled training step) graph-breaks into the eager step:
    the same bits as calling it directly, and the optimizer stays usable."""
    results = []
    for compiled in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 4))
        opt = AdamBridge([p], lr=1e-2, precision="fp32")

        def step(opt=opt):
            opt.step()

        step = torch.compile(step, backend="eager") if compiled else step
        for t in range(3):
            p.grad = torch.full((8, 4), 0.1 * (t + 1))
            step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_a_bad_clipping_state_is_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = AdamBridge([p], lr=0.1, precision="fp32", max_grad_norm=1.0, clip_mode="overlap")
    sd = opt.state_dict()
    for bad in ("half", -1.0, 1.5, math.nan):  # a coefficient is in [0, 1]: -1 reversed updates
        sd["memopt"] = {**sd["memopt"], "clip_coef": bad}
        with pytest.raises(StateDictError, match=r"memopt\['clip_coef'\] must be None or a number"):
            opt.load_state_dict(sd)
    for bad in (-2.0, -math.inf, "1", 10**400):  # 10**400: a bare OverflowError before
        sd["memopt"] = {**sd["memopt"], "clip_coef": 0.5, "last_grad_norm": bad}
        with pytest.raises(StateDictError, match=r"memopt\['last_grad_norm'\] must be None or"):
            opt.load_state_dict(sd)


@pytest.mark.parametrize("clip_mode", ["wait", "overlap"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_state_dict_saved_after_a_non_finite_norm_loads(clip_mode, bad):
    """One step with an inf or NaN gradient element left last_grad_norm inf or NaN (and, with
    clip_mode="overlap", an infinite norm the coefficient 0): load_state_dict refused the
    optimizer's own state dict until a finite step came."""
    p = torch.nn.Parameter(torch.zeros(8))
    kw = dict(lr=0.1, precision="fp32", max_grad_norm=1.0, clip_mode=clip_mode)
    opt = AdamBridge([p], **kw)
    p.grad = torch.ones(8)
    p.grad[3] = bad
    opt.step()
    sd = opt.state_dict()
    assert math.isinf(sd["memopt"]["last_grad_norm"]) or math.isnan(sd["memopt"]["last_grad_norm"])
    if clip_mode == "overlap":
        assert sd["memopt"]["clip_coef"] == (0.0 if bad == math.inf else 1.0)
    q = torch.nn.Parameter(torch.zeros(8))
    twin = AdamBridge([q], **kw)
    twin.load_state_dict(copy.deepcopy(sd))
    for t in range(2):
        for w, o in ((p, opt), (q, twin)):
            w.grad = torch.full((8,), 0.5 * (t + 1))
            o.step()
    assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))  # NaN too


def test_a_clipping_runs_coefficient_does_not_scale_a_run_that_does_not_clip():
    """A state dict saved by an overlap-clipping run carries its last coefficient; loaded into
    an AdamBridge without max_grad_norm, it scaled every later gradient (audit round 4)."""
    kw = dict(lr=1.0, betas=(0.0, 0.0), eps=1e6, precision="fp32", pin_memory=False)
    src = AdamBridge([torch.nn.Parameter(torch.zeros(64))], **kw)
    sd = src.state_dict()
    out = []
    for coef in (0.25, None):
        w = torch.nn.Parameter(torch.zeros(64))
        opt = AdamBridge([w], **kw)  # no clipping
        opt.load_state_dict({**sd, "memopt": {**sd["memopt"], "clip_coef": coef}})
        w.grad = torch.ones(64)
        opt.step()
        opt.synchronize()
        out.append(w.detach().clone())
    assert torch.equal(out[0], out[1])
    # betas (0, 0) and eps 1e6: the update is about -lr * g / eps, unscaled (0.25 made -2.5e-7)
    assert torch.allclose(out[0], torch.full((64,), -1e-6), rtol=1e-4, atol=0)


# --------------------------------------------------------------- audit round 3 (2026-12-01)
def test_parameters_it_cannot_update_in_place_are_refused():
    """Lazy, inference-mode, expanded and memory-sharing parameters, and one parameter in two
    groups: each refused with ConfigError at construction (an expanded one had failed at the
    upload after other parameters were updated; shared memory kept one update of two)."""
    with pytest.raises(ConfigError, match="not initialized yet"):
        AdamBridge(torch.nn.LazyLinear(4).parameters(), precision="fp32")
    with torch.inference_mode():
        q = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"created under torch\.inference_mode"):
        AdamBridge([torch.nn.Parameter(q, requires_grad=False)], precision="fp32")
    wide = torch.nn.Parameter(torch.zeros(1, 8).expand(4, 8))
    with pytest.raises(ConfigError, match="expanded tensor"):
        AdamBridge([wide], precision="fp32")
    base = torch.zeros(8)
    with pytest.raises(ConfigError, match="share memory"):
        AdamBridge([torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])], precision="fp32")
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="already in another param group"):
        AdamBridge([{"params": [p]}, {"params": [p]}], precision="fp32")


@pytest.mark.parametrize(("key", "value"), [("precision", "fp32"), ("max_grad_norm", 1.0)])
def test_optimizer_wide_settings_in_a_group_are_refused(key, value):
    """They were ignored silently (a group's max_grad_norm clipped nothing)."""
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=f"{key} \\(param group 1\\): it is an AdamBridge-wide"):
        AdamBridge([{"params": [p]}, {"params": [q], key: value}], precision="bf16")


def test_a_step_inside_inference_mode_is_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = AdamBridge([p], lr=0.1, precision="fp32")
    p.grad = torch.ones(4)
    with torch.inference_mode(), pytest.raises(ConfigError, match="inference_mode"):
        opt.step()
    opt.step()
    assert (p.detach() < 0).all()


def _linear_pair():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


def _interrupting_copy_out(at: str):
    """AdamBridge._copy_out whose second call raises KeyboardInterrupt before the copy
    (``at="copy"``) or after it, before the bucket is handed on (``"free"``)."""
    real, calls = AdamBridge._copy_out, []

    def flaky(self, bucket):
        calls.append(1)
        if len(calls) == 2 and at == "copy":
            raise KeyboardInterrupt
        real(self, bucket)
        if len(calls) == 2:
            raise KeyboardInterrupt

    return flaky


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("at", ["copy", "free"])
def test_an_interrupt_while_a_bucket_leaves_is_finished_by_the_next_step(monkeypatch, hooks, at):
    """A Ctrl-C (or an out-of-memory error) while a bucket's gradients leave for the host: the
    bucket had been replaced by a new one first, so its gradients were dropped or left in .grad
    (added to the next backward's), and every later step raised 'arrived twice'. Now the bucket
    stays open until they have left, and the next step sends it: the same bits as without the
    interrupt."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))

    def train(interrupt):
        model = _linear_pair()
        opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32", bucket_mb=0.01)
        if hooks:
            opt.attach_hooks(model)
        for t in range(3):
            if interrupt and t == 1:
                monkeypatch.setattr(AdamBridge, "_copy_out", _interrupting_copy_out(at))
                with pytest.raises(KeyboardInterrupt):  # noqa: PT012 - from backward or step
                    (model(x) * (t + 1)).pow(2).mean().backward()
                    opt.step()
                monkeypatch.undo()
                if not hooks:  # torch's loop: the step is retried with the same gradients
                    opt.step()
                else:
                    opt.step_sync()
            else:
                (model(x) * (t + 1)).pow(2).mean().backward()
                opt.step_sync() if hooks else opt.step()
            opt.zero_grad()
        if hooks:
            opt.detach_hooks()
        return model

    assert_same_params(train(True), train(False), f"interrupted at the {at}")


def test_a_fork_with_updates_in_flight_raises_in_the_child():
    """The child of a fork has no dispatcher thread, and an update that was running may have
    been half-written into the host state it copied: waiting for it hung forever. Now every
    wait or submit in that child raises OffloadError; the parent is unaffected."""
    import os
    import threading

    from memopt_offload.bridge import _Bucket, _Dispatcher

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    d = _Dispatcher()
    release = threading.Event()
    d.submit(_Bucket(), lambda bucket: release.wait(10))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            d.wait()
            os.write(w, b"returned")
        except OffloadError as e:
            os.write(w, b"OffloadError " + str(e)[:40].encode())
        except BaseException as e:
            os.write(w, repr(e)[:80].encode())
        os._exit(0)
    os.close(w)
    release.set()
    assert d.wait() is None
    os.waitpid(pid, 0)
    msg = os.read(r, 200).decode()
    os.close(r)
    assert msg.startswith("OffloadError this process was forked while"), msg


def test_an_error_outside_the_updates_reaches_the_waits(monkeypatch):
    """The dispatcher probes which queued bucket is ready (``event.query()`` on CUDA, which
    raises after a device error in the user's backward). That probe ran outside the try of an
    update: the thread died, and ``step_sync()`` waited for it forever. Now the error fails the
    queued updates and every wait returns it."""
    import threading

    from memopt_offload.bridge import _Bucket, _Dispatcher

    def fails(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_Bucket, "ready", fails)
    d = _Dispatcher()
    release = threading.Event()
    ran = []
    first = _Bucket()
    d.submit(first, lambda bucket: release.wait(10))  # holds the thread while two queue
    for _ in range(2):
        d.submit(_Bucket(), lambda bucket: ran.append(bucket))
    release.set()
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(d.wait()), daemon=True)
    waiter.start()
    waiter.join(10)
    assert waited, "wait() blocked on a dispatcher thread that had ended"
    assert isinstance(waited[0], RuntimeError)
    assert "illegal memory access" in str(waited[0])
    assert not ran  # skipped, as the updates after a failed one are
    assert first.done


def test_hyperparameters_set_after_backward_warn_with_hooks():
    """A loop that sets the lr between backward and step (a warmup written that way) got it one
    step late with hooks, silently: the step took its hyperparameters at its first gradient.
    Now it warns (once); set before backward, nothing warns."""
    import warnings

    model = make_model("cpu", dtype=torch.float32)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="fp32", pin_memory=False)
    opt.attach_hooks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(2):  # set before the backward: in time
            opt.param_groups[0]["lr"] = 1e-3 * (t + 1)
            loss_of(model, batch(t, "cpu", torch.float32)).backward()
            opt.step_sync()
    loss_of(model, batch(2, "cpu", torch.float32)).backward()
    opt.param_groups[0]["lr"] = 5e-3
    with pytest.warns(UserWarning, match=r"param group 0's lr changed from 0\.002 to 0\.005"):
        opt.step_sync()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_of(model, batch(3, "cpu", torch.float32)).backward()
        opt.param_groups[0]["lr"] = 6e-3
        opt.step_sync()  # once per optimizer


def test_a_forward_after_another_optimizers_backward_names_the_freeze():
    """A GAN's generator step backpropagates through the discriminator, whose hooks take those
    gradients and update it; torch users drop them with zero_grad(), which cannot undo an
    update under way. The refusal of the discriminator's next forward advised step_sync(), which
    completes that update: it now names the freeze that avoids it."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
    opt_g = AdamBridge(gen.parameters(), lr=1e-2, precision="fp32", pin_memory=False)
    opt_d = AdamBridge(disc.parameters(), lr=1e-2, precision="fp32", pin_memory=False)
    opt_g.attach_hooks(gen)
    opt_d.attach_hooks(disc)
    (-disc(gen(torch.randn(4, 8))).mean()).backward()
    opt_g.step_sync()
    opt_d.zero_grad()
    with pytest.raises(OffloadError, match=r"zero_grad\(\) cannot undo.*requires_grad_\(False\)"):
        disc(torch.randn(4, 16))
    opt_d.step_sync()


@both_updates()
def test_the_models_state_dict_before_step_sync_collects_the_updates(device, precision, update):
    """Between backward and step_sync() the hooks' updates are under way: model.state_dict()
    (a checkpoint or an EMA copy taken there) read some weights updated and others not, where
    only overlap_forward's pre-hook waited. It collects them first now, as the optimizer's own
    state_dict() does: a copy of it holds the weights step_sync() leaves."""
    model = make_model(device)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision=precision, update=update)
    opt.attach_hooks(model)
    loss_of(model, batch(0, device)).backward()
    saved = {n: t.clone() for n, t in model.state_dict().items()}
    opt.step_sync()
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
    assert not all(torch.equal(saved[n], p) for n, p in make_model(device).named_parameters())


@both_updates()
def test_the_models_load_state_dict_before_step_sync_collects_the_updates(
    device, precision, update, monkeypatch
):
    """model.load_state_dict() between backward and step_sync() (dropping a batch on a loss
    spike) raced the hooks' updates: some weights kept the loaded value, others got the update
    (slowed down here, so that every one lost). It collects them first now: the same weights
    and state as step_sync() and then the load."""
    from memopt_offload.device_update import DeviceUpdater

    real_update, real_run = AdamBridge._update, DeviceUpdater.run

    def late_update(self, *args):
        time.sleep(0.05)
        real_update(self, *args)

    def late_run(self, *args):
        time.sleep(0.05)
        real_run(self, *args)

    monkeypatch.setattr(AdamBridge, "_update", late_update)
    monkeypatch.setattr(DeviceUpdater, "run", late_run)
    model = make_model(device)
    twin = copy.deepcopy(model)
    last_good = {n: t.clone() for n, t in model.state_dict().items()}
    opts = []
    for m in (model, twin):
        opt = AdamBridge(
            m.parameters(), lr=1e-2, precision=precision, update=update, **BOTH[update]
        )
        opt.attach_hooks(m)
        opts.append(opt)
    loss_of(twin, batch(0, device)).backward()
    opts[1].step_sync()
    twin.load_state_dict(last_good)
    loss_of(model, batch(0, device)).backward()
    model.load_state_dict(last_good)  # the updates are still queued (slowed down)
    opts[0].step_sync()
    assert all(torch.equal(last_good[n], p) for n, p in model.named_parameters())
    a, b = (o.state_dict()["state"] for o in opts)
    for i in a:
        for key, t in a[i].items():
            assert torch.equal(t, b[i][key]), (i, key)
    assert all(s["step"].item() == 1 for s in a.values())
    for m, opt in zip((model, twin), opts, strict=True):  # and they train on alike
        loss_of(m, batch(1, device)).backward()
        opt.step_sync()
    assert_same_params(model, twin)


def test_a_saved_state_dict_holds_the_state_only():
    """The masters are views of a slab that also holds the gradient buffers: torch.save wrote
    those too (7.07 B per parameter for compact's 5.06)."""
    import io

    p = torch.nn.Parameter(torch.randn(256, 128).bfloat16())
    opt = AdamBridge([p], precision="compact", pin_memory=False)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    held = sum(t.nbytes for s in sd["state"].values() for t in s.values() if torch.is_tensor(t))
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert buf.tell() < held * 1.01 + 4096


def test_a_gradient_taken_by_an_earlier_hook_is_named():
    """A post-accumulate-grad hook registered before attach_hooks() that takes the gradient
    (p.grad = None, as gradient release does) made AdamBridge's hook fail with an
    AttributeError from inside backward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = AdamBridge(model.parameters(), lr=1e-2, pin_memory=False)
    model.bias.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    opt.attach_hooks(model)
    with pytest.raises(OffloadError, match=r"has no gradient in AdamBridge's hook"):
        model(torch.randn(2, 4)).sum().backward()


@both_updates()
def test_a_foreign_default_device_changes_nothing(device, precision, update):
    """Under ``torch.set_default_device`` of another device ("meta" stands in for "cuda" in a
    script with some parameters on the CPU), the host state is still made in host memory and
    the steps equal the reference's."""
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    xs = [batch(t, device) for t in range(5)]
    torch.set_default_device("meta")
    try:
        opt = AdamBridge(
            model.parameters(), lr=3e-3, precision=precision, update=update, **BOTH[update]
        )
        ref = Reference(ref_model, precision, lr=3e-3)
        opt.attach_hooks(model)
        step_pair(model, ref_model, opt, ref, xs, loss=loss_of)
        opt.detach_hooks()
        state = opt.state_dict()["state"]
    finally:
        torch.set_default_device(None)
    assert all(
        v.device.type == "cpu" for s in state.values() for v in s.values() if torch.is_tensor(v)
    )


def _tied_after_construction(device):
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)])
    return model.to(device, torch.bfloat16)


@both_updates()
@pytest.mark.parametrize("hooks", [False, True])
def test_a_tie_made_after_construction_is_refused_before_any_update(
    device, precision, update, hooks
):
    """``head.weight.data = emb.weight.data`` after the optimizer was built: each parameter was
    updated from its own state and the last upload overwrote the other's update (0.03 off torch's
    AdamW after 3 steps at lr 1e-2). The step's first gradient now finds the moved address
    shared and refuses the step before any gradient leaves."""
    model = _tied_after_construction(device)
    opt = AdamBridge(
        model.parameters(), lr=1e-2, precision=precision, update=update, **BOTH[update]
    )
    model[1].weight.data = model[0].weight.data
    before = model[0].weight.detach().clone()
    if hooks:
        opt.attach_hooks(model)
    ids = torch.tensor([1, 2, 3], device=device)

    def train_step():  # with hooks, backward raises; without, step_sync()
        model[1](model[0](ids)).float().pow(2).sum().backward()
        opt.step_sync()

    with pytest.raises(ConfigError, match="assigning the Parameter itself"):
        train_step()
    assert torch.equal(model[0].weight.detach(), before)
    # the head's gradient came first and was not taken (with hooks, the error ended backward)
    assert model[1].weight.grad is not None


@both_updates()
@pytest.mark.parametrize("hooks", [False, True])
def test_a_cast_after_construction_is_refused_before_any_update(device, precision, update, hooks):
    """``model.float()`` after building on bf16 weights: every step rounded the gradients and the
    uploaded weights to bf16 (update="host"), or failed with "undefined state, reload the last
    checkpoint" (update="device"). Now refused, naming the parameter, before any update."""
    model = make_model(device)
    opt = AdamBridge(
        model.parameters(), lr=1e-2, precision=precision, update=update, **BOTH[update]
    )
    model.float()
    before = [p.detach().clone() for p in model.parameters()]
    if hooks:
        opt.attach_hooks(model)

    def train_step():  # with hooks, backward raises; without, step_sync()
        loss_of(model, batch(0, device, dtype=torch.float32)).backward()
        opt.step_sync()

    with pytest.raises(OffloadError, match=r"is torch\.float32, but its host state was built"):
        train_step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("clip_mode", ["wait", "overlap"])
def test_a_step_without_gradients_reports_a_norm_of_zero(clip_mode):
    """step_sync() returned the previous step's norm after a step that received no gradient (a
    logger or a NaN-norm skip saw a step that did not happen); clip_grad_norm_ over no gradient
    gives 0."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), lr=1e-2, max_grad_norm=1.0, clip_mode=clip_mode)
    loss_of(model, batch(0, "cpu")).backward()
    assert opt.step_sync() > 0
    opt.zero_grad()
    assert opt.step_sync() == 0.0
    assert opt.last_grad_norm == 0.0


def test_a_grad_scaler_with_hooks_is_refused_by_name():
    """The hooks take each gradient during backward, still scaled: torch's GradScaler then failed
    with its internal "No inf checks were recorded for this optimizer"."""
    model = torch.nn.Linear(8, 8)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    opt.attach_hooks(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(model(torch.ones(4, 8)).pow(2).sum()).backward()
    with pytest.raises(OffloadError, match="GradScaler with attach_hooks"):
        scaler.step(opt)
    assert not hasattr(opt, "found_inf")
    assert not hasattr(opt, "grad_scale")


def test_a_grad_scaler_without_hooks_steps_as_torch_adamw():
    model = torch.nn.Linear(8, 8)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="fp32", weight_decay=0.0)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    for m, o in ((model, opt), (ref_model, ref)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for t in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            scaler.scale(m(x).pow(2).sum()).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=0, atol=1e-6)


def test_errors_name_parameters_by_the_groups_param_names():
    model = make_model("cpu")
    names = [n for n, _ in model.named_parameters()]
    opt = AdamBridge([{"params": list(model.parameters()), "param_names": names}], lr=1e-2)
    model[0].weight.data = torch.zeros(3, 3, dtype=torch.bfloat16)  # reshaped: refused
    model[0].weight.grad = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(OffloadError, match=r"parameter 0\.weight of param group 0"):
        opt.step()


@both_updates()
def test_a_float64_default_dtype_changes_nothing(device, precision, update):
    """Under ``torch.set_default_dtype(torch.float64)`` the steps keep the bits of float32's,
    and the device update's saved step counts stay float32 (they took the default dtype)."""
    runs = []
    for default in (torch.float32, torch.float64):
        model = make_model(device)
        xs = [batch(t, device) for t in range(4)]
        opt = AdamBridge(model.parameters(), lr=3e-3, precision=precision, update=update)
        opt.attach_hooks(model)
        torch.set_default_dtype(default)
        try:
            for x in xs:
                loss_of(model, x).backward()
                opt.step_sync()
            state = opt.state_dict()["state"]
        finally:
            torch.set_default_dtype(torch.float32)
        assert all(s["step"].dtype == torch.float32 for s in state.values())
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


# ------------------------------------------------------------------ review of 2026-12-06 (s58)
_COLLECT_EARLY = {
    "model.state_dict": lambda model, opt: model.state_dict(),
    "optimizer.state_dict": lambda model, opt: opt.state_dict(),
    "master_weight": lambda model, opt: opt.master_weight(next(model.parameters())),
    "detach_hooks": lambda model, opt: opt.detach_hooks(),
}


@both_updates()
@pytest.mark.parametrize("collect", sorted(_COLLECT_EARLY))
def test_a_step_collected_before_step_sync_keeps_its_norm(precision, update, collect):
    """With clipping, a read that collects the step between backward and ``step_sync()``
    (``model.state_dict()``, ``optimizer.state_dict()``, ``master_weight()``,
    ``detach_hooks()``) took the norm; the ``step_sync()`` after it closed the step again,
    found no norm, and returned 0.0 (and set ``last_grad_norm`` to 0.0) for a step that had
    gradients."""
    results = []
    for early in (False, True):
        model = make_model("cpu")
        opt = AdamBridge(
            model.parameters(), precision=precision, update=update, max_grad_norm=1.0,
            **BOTH[update],
        )  # fmt: skip
        opt.attach_hooks(model)
        loss_of(model, batch(0, "cpu")).backward()
        if early:
            _COLLECT_EARLY[collect](model, opt)
        results.append((opt.step_sync(), opt.last_grad_norm))
    assert results[0][0] > 0
    assert results[1] == results[0]


def test_a_nan_step_collected_before_step_sync_reports_nan():
    """The worst case of the above: a NaN step (its weights went NaN) reported 0.0 after a
    checkpoint taken before ``step_sync()``, so a loop that skips or alerts on a non-finite
    norm missed it."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), max_grad_norm=1.0)
    opt.attach_hooks(model)
    x = batch(0, "cpu")
    x[0, 0] = float("nan")
    loss_of(model, x).backward()
    model.state_dict()
    assert math.isnan(opt.step_sync())
    assert math.isnan(opt.last_grad_norm)


@both_updates()
def test_a_retried_step_sync_after_an_interrupt_keeps_the_norm(monkeypatch, precision, update):
    """``step_sync()`` interrupted (Ctrl-C while it waits for the updates) took the norm; the
    retried call returned 0.0 and set ``last_grad_norm`` to 0.0."""
    from memopt_offload.bridge import _Dispatcher

    model = make_model("cpu")
    opt = AdamBridge(
        model.parameters(), precision=precision, update=update, max_grad_norm=1.0, **BOTH[update]
    )
    opt.attach_hooks(model)
    loss_of(model, batch(0, "cpu")).backward()
    wait, calls = _Dispatcher.wait, []

    def interrupted_once(self):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while step_sync() waits for the updates
        return wait(self)

    monkeypatch.setattr(_Dispatcher, "wait", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        opt.step_sync()
    norm = opt.last_grad_norm
    assert norm > 0
    assert opt.step_sync() == norm
    assert opt.last_grad_norm == norm


@pytest.mark.parametrize("after", ["state_dict", "detach_hooks"])
def test_overlap_forward_keeps_the_norm_after_a_collecting_call(after):
    """With ``overlap_forward``, ``optimizer.state_dict()`` or ``detach_hooks()`` right after
    ``step_sync()`` collected the updates in flight and reset ``last_grad_norm`` to 0.0 (and
    the checkpoint saved 0.0)."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters(), max_grad_norm=1.0)
    opt.attach_hooks(model, overlap_forward=True)
    loss_of(model, batch(0, "cpu")).backward()
    norm = opt.step_sync()
    assert norm > 0
    if after == "state_dict":
        assert opt.state_dict()["memopt"]["last_grad_norm"] == norm
    else:
        opt.detach_hooks()
    assert opt.last_grad_norm == norm


def test_an_item_submitted_while_the_failed_dispatcher_thread_ends_runs(monkeypatch):
    """After the dispatcher loop failed outside an update, ``fail_queued()`` returned and the
    thread was still alive for a moment: a ``submit()`` in that window saw ``is_alive()``,
    started no thread, and queued an item nobody ran, so ``wait()`` blocked forever. The window
    is held open here until the item was submitted."""
    import threading

    from memopt_offload.bridge import _Bucket, _Dispatcher

    in_window, proceed = threading.Event(), threading.Event()
    fail_queued = _Dispatcher.fail_queued

    def held_open(self, error):
        fail_queued(self, error)
        in_window.set()  # the lock is released, the thread not ended yet
        proceed.wait(10)

    def fails(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_Dispatcher, "fail_queued", held_open)
    monkeypatch.setattr(_Bucket, "ready", fails)
    d = _Dispatcher()
    release = threading.Event()
    d.submit(_Bucket(), lambda bucket: release.wait(10))  # holds the thread while two queue
    for _ in range(2):
        d.submit(_Bucket(), lambda bucket: None)
    release.set()  # next_item() probes ready() with two queued: the loop fails
    assert in_window.wait(10)
    d.submit(_Bucket(), lambda bucket: None)
    proceed.set()
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(d.wait()), daemon=True)
    waiter.start()
    waiter.join(10)  # without the fix it blocks forever: fail, not hang
    assert waited, "wait() blocked on an item queued for a dispatcher thread that had ended"
    assert isinstance(waited[0], RuntimeError)  # the step's error, as for the other items
    assert d._done == d._submitted
    d.stop()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_module_list_of_two_models_refuses_a_forward_before_step_sync(overlap):
    """A second ``attach_hooks`` advises hooking two models as one ``nn.ModuleList``; the
    forward pre-hook went on the list, which is never called, so a forward before
    ``step_sync()`` read the weights unchecked (half-updated). The hooks now go on the models
    in it; with ``overlap_forward`` the read guard of the first forward ends with it."""
    from torch.overrides import _get_current_function_mode_stack

    a, b = make_model("cpu"), make_model("cpu", seed=1)
    opt = AdamBridge([*a.parameters(), *b.parameters()], lr=1e-2)
    opt.attach_hooks(torch.nn.ModuleList([a, b]), overlap_forward=overlap)
    with pytest.raises(ConfigError, match="ModuleList of both"):
        opt.attach_hooks(b)
    x = batch(0, "cpu")
    (loss_of(a, x) + loss_of(b, x)).backward()
    for model in (a, b):
        with pytest.raises(OffloadError, match="started while 12 parameter update"):
            model(x)
    opt.step_sync()
    a(x)
    b(x)
    assert not _get_current_function_mode_stack()  # no read guard left on after a's forward
    opt.detach_hooks()


def test_detach_hooks_after_a_failed_update_removes_them():
    """``detach_hooks()`` (documented idempotent) raised the failed update's error before it
    removed the hooks, and left them attached."""
    model = make_model("cpu")
    opt = AdamBridge(model.parameters())
    opt.attach_hooks(model)

    def fails(bucket, coef):
        raise RuntimeError("injected")

    opt._update = fails
    loss_of(model, batch(0, "cpu")).backward()
    with pytest.raises(OffloadError, match="an update failed"):
        opt.detach_hooks()
    assert not opt.hooks_attached
    opt.detach_hooks()  # still idempotent
    assert not opt.hooks_attached


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("appended", ["parameter", "group", "swapped"])
def test_a_parameter_appended_outside_add_param_group_is_refused(hooks, appended):
    """A parameter appended to ``param_groups[0]["params"]`` (torch's AdamW trains it) has no
    host state, and step() walks the states: it was silently never trained. The step now
    refuses it, by name, when it opens (a group appended to ``param_groups`` likewise, and a
    parameter put in place of one of the group's, which kept its count)."""
    model = make_model("cpu")
    params = list(model.parameters())
    opt = AdamBridge(params[:-1], lr=1e-2)
    if appended == "parameter":
        opt.param_groups[0]["params"].append(params[-1])
        match = r"parameter #5 of param group 0 \(shape \(31,\)\) was added to the group's"
    elif appended == "group":
        opt.param_groups.append({**opt.param_groups[0], "params": [params[-1]]})
        match = r"param_groups has 2 groups, but 1 were added"
    else:
        opt.param_groups[0]["params"][3] = params[-1]
        match = r"parameter #3 of param group 0 \(shape \(31,\)\) is not the parameter the"
    if hooks:
        opt.attach_hooks(model)
    before = params[-1].detach().clone()

    def train_step():  # with hooks, backward raises; without, step_sync()
        loss_of(model, batch(0, "cpu")).backward()
        opt.step_sync()

    with pytest.raises(ConfigError, match=match):
        train_step()
    assert torch.equal(params[-1].detach(), before)


def test_a_precision_that_is_no_string_is_a_config_error():
    """``precision=["bf16"]`` raised ``TypeError: unhashable type: 'list'`` from the lookup."""
    with pytest.raises(ConfigError, match=r"unknown precision \['bf16'\]; choose one of \('fp32'"):
        AdamBridge(make_model("cpu").parameters(), precision=["bf16"])
