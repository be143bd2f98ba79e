"""``capturable=True`` on the GPU: the graph-replayed step (lr and step read from device memory)
gives the reference's bits under a schedule, with groups at different step counts, and the
rules of capture are enforced with clear errors or warnings."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from apexw_testutil import assert_same, make_params, reference_for, set_grads, step_both, twin

from memopt_apexw import ApexW
from memopt_core.errors import ConfigError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("dtype", "state"),
    [(torch.float32, "bf16"), (torch.float32, "q8"), (torch.bfloat16, "q8")],
)
def test_graph_replay_equals_reference_under_a_schedule(dtype, state):
    a = make_params(CUDA, dtype)
    b = twin(a)
    extra_a = make_params(CUDA, dtype, shapes=[(4097,), (3, 33)], seed=3)
    extra_b = twin(extra_a)
    opt = ApexW(a, state=state, capturable=True, mode="fused")
    ref = reference_for(b, state=state)
    for step in range(1, 121):
        for o in (opt, ref):  # a warmup-then-cosine schedule, set as schedulers set it
            for g in o.param_groups:
                g["lr"] = 1e-2 * min(step / 10, 0.5 + 0.5 * math.cos(math.pi * step / 120))
        if step == 30:  # a group joining later runs at its own step count in the same graph
            opt.add_param_group({"params": extra_a, "weight_decay": 0.3})
            ref.add_param_group({"params": extra_b, "weight_decay": 0.3})
        if step >= 30:
            set_grads(extra_a, step)
            set_grads(extra_b, step)
        step_both(a, b, opt, ref, step)
        if step in (1, 2, 3, 4, 29, 31, 120):
            assert_same(a + extra_a, b + extra_b, opt, ref, f"step {step}")
    assert opt._graph is not None
    assert opt._graph.graph is not None  # it did replay a graph
    assert {e.backend.name for e in opt._cached_steps["fused"].entries} == {"triton"}


def test_moved_gradients_recapture_with_a_warning():
    a = make_params(CUDA)
    b = twin(a)
    opt = ApexW(a, capturable=True, mode="fused")
    ref = reference_for(b)

    def run(steps):
        for step in steps:
            step_both(a, b, opt, ref, step, in_place=False)  # new gradient tensors every step

    with pytest.warns(UserWarning, match="captured its step again"):
        run(range(1, 9))
    assert_same(a, b, opt, ref)


def test_stepping_inside_a_user_graph_is_refused():
    a = make_params(CUDA)
    opt = ApexW(a, capturable=True, mode="fused")
    for step in range(1, 4):
        set_grads(a, step)
        opt.step()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device=CUDA)

    def user_step():
        x.add_(1)  # the user's own work (an empty graph makes torch warn)
        opt.step()

    with (
        pytest.raises(ConfigError, match="cannot be captured inside another CUDA graph"),
        torch.cuda.graph(g),
    ):
        user_step()


def test_many_tiny_tensors_in_one_launch():
    shapes = [(1 + (i * 37) % 300,) for i in range(3000)]
    a = make_params(CUDA, shapes=shapes)
    b = twin(a)
    opt = ApexW(a, state="q8", mode="fused", capturable=True)
    ref = reference_for(b, state="q8")
    for step in range(1, 6):
        step_both(a, b, opt, ref, step)
    assert_same(a, b, opt, ref)
    assert len(opt._cached_steps["fused"].entries) == 1


@pytest.mark.parametrize(
    ("mode", "capturable"), [("fused", True), ("fused", False), ("auto", False)]
)
@pytest.mark.gpu(min_devices=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_parameters_on_another_gpu_than_the_current_one(mode, capturable):
    """A model on cuda:1 while cuda:0 is current (moved with ``.to("cuda:1")``): the captured
    graph, its scalar uploads, the eager launches and the auto mode's timed trials all run on
    cuda:1, with the reference's bits, and the current device stays cuda:0."""
    dev = torch.device("cuda", 1)
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        a = make_params(dev)
        b = twin(a)
        opt = ApexW(a, capturable=capturable, mode=mode)
        ref = reference_for(b)
        for step in range(1, 13):
            step_both(a, b, opt, ref, step)
            assert torch.cuda.current_device() == 0
        assert_same(a, b, opt, ref)
        if capturable:
            assert opt._graph is not None
            assert opt._graph.graph is not None
    finally:
        torch.cuda.set_device(before)


def test_captured_steps_warn_past_2_24():
    """The captured step counted past 2**24 without the eager step's warning (audit F5)."""
    a = make_params(CUDA)
    opt = ApexW(a, capturable=True, mode="fused")
    set_grads(a, 1)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = torch.full_like(st["step"], 2**24 - 4)
    opt.load_state_dict(sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2, 8):  # ordinary, warm launch, capture, then replays past 2**24
            set_grads(a, step)
            opt.step()
    assert opt._graph is not None
    assert opt._graph.graph is not None
    assert [str(w.message)[:26] for w in caught if w.category is RuntimeWarning] == [
        "step counts reached 2**24 "
    ]
