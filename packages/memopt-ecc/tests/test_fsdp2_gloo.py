"""The Flash* family under FSDP2 (``fully_shard``): 2 ranks (gloo on the CPU; NCCL on 2 GPUs in
``nox -s gpu_tests`` where the host has them) end with the
weights and optimizer state (each rank's shard of it) one process gets from the averaged
gradients, bit for bit, with and without resharding after forward and with gradient release
(FSDP2 runs the post-accumulate-grad hooks on the sharded parameters after its reduce-scatter);
and the fp32 state dict of a sharded model.

The model's shards start on q8 block boundaries (see memopt_core.sharding for what happens to a
block cut by a shard), and each rank draws the stochastic-rounding words of its elements'
positions in the whole tensor, so the ranks reproduce one process exactly.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
from ecc_testutil import bits
from fsdp2_ecc import OPTIMIZERS, loss_of, make_model, make_optimizer, prepare, state_of, worker

import memopt_ecc
from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.errors import StateDictError
from memopt_core.testing import Fsdp2Job, set_mean_gradients, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 5
#: job name -> (optimizer, reshard after forward, gradient release)
JOBS = {
    **{name: (name, True, False) for name in OPTIMIZERS},
    "FlashAdamW-keep": ("FlashAdamW", False, False),
    "FlashAdamW-release": ("FlashAdamW", True, True),
    "FlashLion-release-keep": ("FlashLion", False, True),
}


@pytest.fixture(scope="module", params=DIST_DEVICES)
def results(request, tmp_path_factory):
    """Every job trained by 2 ranks in one spawn: gloo on the CPU, or NCCL on 2 GPUs."""
    device = request.param
    out = tmp_path_factory.mktemp(f"fsdp2-{device}")
    jobs = [
        Fsdp2Job(
            job,
            make_model,
            functools.partial(make_optimizer, name),
            loss_of,
            STEPS,
            reshard,
            functools.partial(prepare, job, released),
            released,
        )
        for job, (name, reshard, released) in JOBS.items()
    ]
    args = (2, str(out / "init"), str(out), jobs, device)
    outs = [
        out / f"{j.name}-{what}rank{r}.pt" for j in jobs for what in ("", "state-") for r in (0, 1)
    ]
    spawn_ranks(worker, args, 2, outs)
    return device, out


def _reference(name: str, device: str):
    """One process's weights (by name) and its optimizer's :func:`fsdp2_ecc.state_of`."""
    model = make_model().to(device)
    opt = make_optimizer(name, model.parameters())
    for t in range(STEPS):
        set_mean_gradients(model, [functools.partial(loss_of, model, t, r) for r in (0, 1)])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}, state_of(opt)


@pytest.mark.parametrize("job", list(JOBS))
def test_fsdp2_two_ranks_equal_one_process(job, results):
    """The ranks' weights equal one process's bit for bit, and so do their optimizer states: every
    shard starts on a q8 block and holds half of each tensor, so rank 0's state tensors (master
    codes, moment codes, block scales) followed by rank 1's are one process's, flattened."""
    device, out = results
    want, want_state = _reference(JOBS[job][0], device)
    initial = dict(make_model().named_parameters())
    assert not any(torch.equal(v, initial[k]) for k, v in want.items())  # the steps moved them
    for rank in (0, 1):
        got = torch.load(out / f"{job}-rank{rank}.pt", weights_only=True)
        for k, v in want.items():
            assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), (rank, k)
    shards = [torch.load(out / f"{job}-state-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(want_state)
    for i, entry in enumerate(want_state):
        assert "master_code" in entry  # the codes and the moments are compared
        assert any(k.startswith(("exp_avg", "momentum_buffer")) for k in entry), sorted(entry)
        for rank in (0, 1):
            assert sorted(shards[rank][i]) == sorted(entry), (rank, i)
        for k, v in entry.items():
            if k == "step":  # a count, the same on every rank
                assert all(torch.equal(s[i][k], v) for s in shards), (i, k)
                continue
            halves = [bits(s[i][k]).reshape(-1) for s in shards]
            assert halves[0].numel() == halves[1].numel(), (i, k)
            assert torch.equal(torch.cat(halves), bits(v).reshape(-1)), (i, k)


@contextlib.contextmanager
def _one_rank(tmp_path):
    """A one-process gloo group (a one-rank mesh for fully_shard in this process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained_plain_and_sharded(**kw):
    """The test model plain and under fully_shard, each with a FlashAdamW(lr=1e-2, **kw), after
    the same 3 steps."""
    from torch.distributed.fsdp import fully_shard

    plain, sharded = make_model(), make_model()
    fully_shard(sharded)
    opts = [memopt_ecc.FlashAdamW(m.parameters(), lr=1e-2, **kw) for m in (plain, sharded)]
    for t in range(3):
        for m, o in zip((plain, sharded), opts, strict=True):
            loss_of(m, t, 0).backward()
            o.step()
            o.zero_grad()
    return (plain, sharded), opts


def test_fp32_state_dict_of_a_sharded_model(tmp_path):
    """get_fp32_model_state_dict hands out DTensors sharded like the parameters, holding the
    decoded masters; set_fp32_model_state_dict takes them back (a one-rank mesh)."""
    from torch.distributed.tensor import DTensor

    with _one_rank(tmp_path):
        (plain, sharded), opts = _trained_plain_and_sharded()
        want = memopt_ecc.get_fp32_model_state_dict(plain, opts[0])
        got = memopt_ecc.get_fp32_model_state_dict(sharded, opts[1])
        for k, v in want.items():
            assert isinstance(got[k], DTensor), k
            assert torch.equal(got[k].full_tensor(), v), k
        assert not all(torch.equal(v, v.bfloat16().float()) for v in want.values())  # ECC bits
        shifted = {k: v + 0.25 for k, v in got.items()}
        memopt_ecc.set_fp32_model_state_dict(sharded, opts[1], shifted)
        back = memopt_ecc.get_fp32_model_state_dict(sharded, opts[1])
        ref = {k: v + 0.25 for k, v in want.items()}
        memopt_ecc.set_fp32_model_state_dict(plain, opts[0], ref)
        ref = memopt_ecc.get_fp32_model_state_dict(plain, opts[0])
        for k, v in ref.items():
            assert torch.equal(back[k].full_tensor(), v), k
        with pytest.raises(StateDictError, match="sharded"):
            memopt_ecc.set_fp32_model_state_dict(sharded, opts[1], want)


def test_check_numerics_on_a_sharded_model(tmp_path):
    """check_numerics on FSDP2 parameters (DTensors; a one-rank mesh): the resolution check
    raised RuntimeError (.tolist() of a DTensor) at every step. Now each process checks its
    shard: the same steps as the plain model, a too-small lr and a NaN refused alike."""
    from memopt_core import NumericsError

    with _one_rank(tmp_path):
        (plain, sharded), opts = _trained_plain_and_sharded(check_numerics=True)
        want = memopt_ecc.get_fp32_model_state_dict(plain, opts[0])
        got = memopt_ecc.get_fp32_model_state_dict(sharded, opts[1])
        for k, v in want.items():
            assert torch.equal(got[k].full_tensor(), v), k
        for m, o in zip((plain, sharded), opts, strict=True):
            loss_of(m, 3, 0).backward()
            for g in o.param_groups:
                g["lr"] = 1e-12  # far below ECC-24's resolution at these weights
            with pytest.raises(NumericsError, match="below the master format's resolution"):
                o.step()
            for g in o.param_groups:
                g["lr"] = 1e-2
            next(iter(m.parameters())).grad.view(-1)[0] = float("nan")
            with pytest.raises(NumericsError, match="non-finite gradient"):
                o.step()


def test_uncompressed_state_dict_of_a_sharded_model_loads_back(tmp_path):
    """compress_state_dict=False on FSDP2 parameters (a one-rank mesh): the decoded moments are
    DTensors without a scale field, which core's sharded load refused ("some of its fields as
    DTensors and some not") even for the optimizer's own state_dict(). Now a fresh optimizer
    loads it and continues with the bits of the run it was saved from."""
    from torch.distributed.fsdp import fully_shard

    def build():
        model = make_model()
        fully_shard(model)
        return model, memopt_ecc.FlashAdamW(model.parameters(), lr=1e-2, compress_state_dict=False)

    def train(model, opt, steps):
        for t in steps:
            loss_of(model, t, 0).backward()
            opt.step()
            opt.zero_grad()

    with _one_rank(tmp_path):
        straight, sopt = build()
        train(straight, sopt, range(5))
        first, fopt = build()
        train(first, fopt, range(3))
        sd = copy.deepcopy(fopt.state_dict())
        assert "exp_avg_scale" not in next(iter(sd["state"].values()))  # decoded moments
        resumed, ropt = build()
        resumed.load_state_dict(first.state_dict())
        ropt.load_state_dict(sd)
        train(resumed, ropt, range(3, 5))
        for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(bits(p.full_tensor()), bits(q.full_tensor()))
