"""A default device other than the model's (``torch.set_default_device``, or ``with
torch.device(...)``) changes nothing in a checkpoint: every tensor memopt-checkpoint makes
(file buffers, exported states, fp32 weights) is placed on the CPU. "meta" stands in for the
foreign device: a tensor made there has no memory, so a forgotten ``device=`` fails here."""

from __future__ import annotations

import pytest
import test_save_load as sl
import torch

from memopt_checkpoint import (
    fp32_model_state_dict,
    load,
    load_torch_state_dict,
    save,
    to_torch_state_dict,
)


@pytest.mark.parametrize("family", list(sl.FAMILIES))
def test_save_load_and_export_under_a_foreign_default_device(family, tmp_path):
    sync = family.startswith("adambridge")
    straight, sopt = sl.build(family)
    sl.train(straight, sopt, 6, sync=sync)

    first, fopt = sl.build(family)
    sl.train(first, fopt, 3, sync=sync)
    resumed, ropt = sl.build(family, seed=123)
    with torch.device("meta"):
        save(tmp_path / "ck.mopt", model=first, optimizer=fopt)
        load(tmp_path / "ck.mopt", model=resumed, optimizer=ropt)
        weights = fp32_model_state_dict(first, fopt)
    assert all(w.device.type == "cpu" and w.dtype == torch.float32 for w in weights.values())
    sl.train(resumed, ropt, 3, start=3, sync=sync)
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.detach().float(), q.detach().float()), name


def test_torch_interop_under_a_foreign_default_device():
    model, opt = sl.build("memopt-q8-fp32")
    sl.train(model, opt, 3)
    with torch.device("meta"):
        sd = to_torch_state_dict(opt)
    assert all(v.device.type == "cpu" for s in sd["state"].values() for v in s.values())
    _, other_opt = sl.build("memopt-q8-fp32", seed=5)
    with torch.device("meta"):
        load_torch_state_dict(other_opt, sd)
    assert all(v.device.type == "cpu" for s in other_opt.state.values() for v in s.values())
    again = to_torch_state_dict(other_opt)["state"]  # the loaded codes decode to what was saved
    for key, saved in sd["state"].items():
        for name, value in saved.items():
            assert torch.equal(again[key][name], value), (key, name)
