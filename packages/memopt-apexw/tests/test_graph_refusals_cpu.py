"""The capture checks of ``capturable=True`` on CPU tensors, in Triton's interpreter: a strided
parameter or gradient is refused before anything CUDA-specific runs and before the step changes
anything, naming its param group (the checks go through the groups in order). ``capturable=True`` refuses CPU parameters when they are added, so these tests set it
after construction (as test_fsdp2_gloo does): the cached step's checks then run as on CUDA, up
to the device check (the GPU variants are in test_graph_gpu_scaler.py)."""

from __future__ import annotations

import pytest
import torch
from apexw_testutil import make_params, set_grads, triton_interpreter_ready

from memopt_apexw import ApexW
from memopt_core.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not triton_interpreter_ready(),
    reason="needs memopt-kernels-triton, triton and numpy with TRITON_INTERPRET=1",
)
STRIDED = "contiguous parameters and gradients"


def capturing(groups) -> ApexW:
    opt = ApexW(groups, mode="fused", backend="triton", mode_cache=None)
    opt.capturable = True  # what capturable=True would ask for (CUDA only at construction)
    return opt


def strided(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A (cols, rows) tensor that is a transposed view: not contiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).t()


@pytest.mark.parametrize("which", ["none", "parameter", "gradient"])
def test_strided_parameter_or_gradient_is_refused_naming_its_group(which):
    a = make_params("cpu", shapes=[(31,), (3, 11)])
    extra = make_params("cpu", shapes=[(7, 5), (33,)], seed=3)
    if which == "parameter":
        extra[0] = strided(5, 7, 4).requires_grad_()
    opt = capturing([{"params": a}, {"params": extra}])
    for step in (1, 2):
        # group 0 has no gradients (on CPU its contiguous parameters would be refused for
        # their device before group 1's turn came)
        set_grads(extra, step)
        if which == "gradient":
            extra[0].grad = strided(5, 7, step)
        if which == "none":
            # the control: contiguous tensors pass the stride check, and the device check after
            # it refuses the CPU parameters
            with pytest.raises(ConfigError, match="captures a CUDA graph; parameters are on CPU"):
                opt.step()
            continue
        assert not (extra[0] if which == "parameter" else extra[0].grad).is_contiguous()
        before = [p.detach().clone() for p in extra]
        # refused at every step: nothing was cached for a later step to replay
        with pytest.raises(ConfigError, match=rf"{STRIDED}.* param group 1 is strided"):
            opt.step()
        assert "fused" not in opt._cached_steps
        # before any change: no weight moved, no state built (a refused step leaves no trace)
        assert all(torch.equal(p, b) for p, b in zip(extra, before, strict=True))
        assert not opt.state


def test_strided_gradient_in_the_first_group_names_group_0():
    a = make_params("cpu", shapes=[(7, 5)])
    extra = make_params("cpu", shapes=[(33,)], seed=3)
    opt = capturing([{"params": a}, {"params": extra}])
    set_grads(a, 1)
    set_grads(extra, 1)
    a[0].grad = a[0].grad.t().contiguous().t()  # the same values in a transposed layout
    with pytest.raises(ConfigError, match=rf"{STRIDED}.* param group 0 is strided"):
        opt.step()
