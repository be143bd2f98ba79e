"""The torch backend's bits recomputed from the definitions alone: ``reference.adam`` on the
decoded state, each result encoded with the words of its own stream (docs/formats.md: the word
of an element depends on seed, tensor id, element index, step and stream). The kernel backends
are compared with the torch backend elsewhere; this pins the torch backend itself, so that a
swapped stream, a wrong tensor id or index, or a step number off by one fails in memopt-core's
own tests (mutation testing found them caught only by memopt-kernels-cpu's comparisons)."""

from __future__ import annotations

import torch

from memopt_core import MemOptimizer, reference, rng
from memopt_core.formats import master_codec, moment_codec
from memopt_core.rng import STREAM_FIRST, STREAM_MASTER, STREAM_SECOND
from memopt_core.testing import bits

SEED = 0xC0FFEE


def _expected(p, grad, state, tensor_id, step, hyper):
    """(param, master code, exp_avg, exp_avg_sq) of one AdamW step of one tensor, recomputed."""
    mcodec = master_codec("ecc24", torch.bfloat16)
    first, second = moment_codec("bf16"), moment_codec("bf16")
    code = state.get("master_code", torch.zeros(p.shape, dtype=torch.uint8))
    x = mcodec.decode(p.detach().reshape(-1), code.reshape(-1)).float()
    zeros = torch.zeros_like(x)
    m = first.decode({"": state["exp_avg"].reshape(-1)}) if "exp_avg" in state else zeros
    v = second.decode({"": state["exp_avg_sq"].reshape(-1)}) if "exp_avg_sq" in state else zeros
    s = reference.adam_scalars(step=step, decoupled=True, **hyper)
    x, m, v = reference.adam(x, grad.float().reshape(-1), m, v, s)
    index = torch.arange(x.numel(), dtype=torch.int64)

    def words(stream):
        return rng.uniform_bits(SEED, tensor_id, index, step, stream)

    p_new, code_new = mcodec.encode(x, rand=words(STREAM_MASTER))
    return (
        p_new,
        code_new,
        first.encode(m, rand=words(STREAM_FIRST))[""],
        second.encode(v, rand=words(STREAM_SECOND))[""],
    )


def test_adamw_ecc24_bf16_moments_from_the_definitions():
    torch.manual_seed(0)
    shapes = [(77,), (5, 7), (33,)]  # tensor ids 0, 1 (first group) and 2 (second group)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    hyper = [
        dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
        dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
    ]
    opt = MemOptimizer(
        [{"params": params[:2], **hyper[0]}, {"params": params[2:], **hyper[1]}],
        rule="adamw",
        master="ecc24",
        moments="bf16",
        stochastic_rounding=True,
        backend="torch",
        seed=SEED,
    )
    for step in (1, 2, 3):
        grads = [torch.randn(s).bfloat16() for s in shapes]
        want = []
        for tid, (p, g) in enumerate(zip(params, grads, strict=True)):
            state = {k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else {}
            want.append(_expected(p, g, state, tid, step, hyper[0 if tid < 2 else 1]))
            p.grad = g
        opt.step()
        for p, (p_new, code_new, m, v) in zip(params, want, strict=True):
            st = opt.state[p]
            assert torch.equal(bits(p.detach().reshape(-1)), bits(p_new)), f"param, step {step}"
            assert torch.equal(st["master_code"].reshape(-1), code_new), f"code, step {step}"
            assert torch.equal(bits(st["exp_avg"].reshape(-1)), bits(m)), f"m, step {step}"
            assert torch.equal(bits(st["exp_avg_sq"].reshape(-1)), bits(v)), f"v, step {step}"
