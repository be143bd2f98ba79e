"""cast_model: dtypes, fnmatch patterns and module objects, the two full-precision lists,
BatchNorm kept fp32 inside a bf16 network, tied weights."""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn

from memopt_core import ConfigError
from memopt_ecc import FlashAdamW, cast_model


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.attn(x))


class Net(nn.Module):
    """embed -> blocks -> bn -> decoder (with a nested head) -> head; embed tied to out."""

    def __init__(self, d: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.bn = nn.BatchNorm1d(d)
        self.decoder = nn.Sequential()
        self.decoder.add_module("proj", nn.Linear(d, d))
        self.decoder.add_module("head", nn.Linear(d, d))
        self.head = nn.Linear(d, 3)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        x = self.bn(x)
        x = self.decoder(x)
        return self.head(x), self.out(x)


def dtypes(model):
    return {name: t.dtype for name, t in model.state_dict().items()}


def test_default_cast_keeps_batchnorm_fp32(device):
    torch.manual_seed(0)
    model = Net().to(device)
    assert cast_model(model) is model
    d = dtypes(model)
    for name, dt in d.items():
        if name.startswith("bn."):
            want = torch.int64 if name == "bn.num_batches_tracked" else torch.float32
        elif name == "counter":
            want = torch.int64
        else:
            want = torch.bfloat16
        assert dt == want, name
    # tied weights stay one Parameter
    assert model.out.weight is model.embed.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    head, logits = model(torch.randint(0, 11, (6,), device=device))
    assert head.dtype == torch.bfloat16
    assert logits.dtype == torch.bfloat16


def test_batchnorm_runs_fp32_statistics_on_bf16_input(device):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5).to(device)
    ref = copy.deepcopy(bn)
    model = nn.Sequential(bn)
    cast_model(model)
    x = torch.randn(16, 5, device=device).bfloat16()
    y = model(x)
    assert y.dtype == torch.bfloat16  # cast back to the input's dtype
    want = ref(x.float())  # fp32 statistics on the widened input
    assert torch.equal(y, want.bfloat16())
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert torch.equal(bn.running_var, ref.running_var)
    assert bn.running_mean.dtype == torch.float32
    # an fp32 input stays fp32
    assert model(torch.randn(4, 5, device=device)).dtype == torch.float32


def test_selective_false_casts_batchnorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    cast_model(model, selective=False)
    assert all(t.dtype == torch.bfloat16 for t in model[1].parameters())
    assert model[1].running_mean.dtype == torch.bfloat16
    assert model[1].num_batches_tracked.dtype == torch.int64
    assert not model[1]._forward_pre_hooks


def test_patterns_match_full_dotted_names():
    model = Net()
    model.out.weight = nn.Parameter(torch.randn(11, 8))  # untie for this test
    cast_model(model, full_precision_layers=["head"])  # the top-level head only
    assert model.head.weight.dtype == torch.float32
    assert model.decoder.head.weight.dtype == torch.bfloat16

    model = Net()
    model.out.weight = nn.Parameter(torch.randn(11, 8))
    cast_model(model, full_precision_layers=["*.head"])  # nested heads, not the top-level one
    assert model.decoder.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16

    model = Net()
    model.out.weight = nn.Parameter(torch.randn(11, 8))
    cast_model(model, full_precision_recast_layers=["blocks.*.attn"])
    assert model.blocks[0].attn.weight.dtype == torch.float32
    assert model.blocks[1].attn.bias.dtype == torch.float32
    assert model.blocks[0].norm.weight.dtype == torch.bfloat16


def test_full_precision_output_stays_fp32_recast_output_is_cast_back(device):
    torch.manual_seed(0)
    model = Net().to(device)
    model.out.weight = nn.Parameter(torch.randn(11, 8, device=device))
    cast_model(
        model,
        full_precision_layers=[model.head],  # a module object
        full_precision_recast_layers=["decoder"],  # a subtree: decoder.proj, decoder.head
    )
    assert model.head.weight.dtype == torch.float32
    assert {p.dtype for p in model.decoder.parameters()} == {torch.float32}
    seen = {}

    def spy(m, a, o):
        seen["proj"] = o.dtype  # returns None: observes, replaces nothing

    model.decoder.proj.register_forward_hook(spy)
    head, logits = model(torch.randint(0, 11, (5,), device=device))
    assert head.dtype == torch.float32  # terminal layer: fp32 output
    assert seen["proj"] == torch.float32  # inside the recast subtree everything is fp32
    assert logits.dtype == torch.bfloat16  # decoder's output was cast back, out is bf16


class Output(collections.OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict whose items are attributes too."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


Pair = collections.namedtuple("Pair", ["a", "b"])


class Tagged(list):
    """A list subclass with an attribute of its own."""

    tag = "?"


class Row(tuple):
    """A tuple subclass built from its items, as tuple is."""


class Span(tuple):
    """A tuple subclass whose constructor takes other arguments."""

    def __new__(cls, start, stop):
        return super().__new__(cls, (start, stop))


@dataclasses.dataclass(frozen=True)
class Result:
    y: torch.Tensor
    n: int


def pack(kind, y):
    """``y`` in a container of ``kind``."""
    if kind == "max":
        return torch.max(y, dim=1)
    if kind == "ordered":
        return collections.OrderedDict(y=y, n=torch.arange(2))
    if kind == "model-output":
        out = Output()
        out["logits"] = y
        return out
    if kind == "list-subclass":
        out = Tagged([y, torch.arange(2)])
        out.tag = "kept"
        return out
    if kind == "dataclass":
        return Result(y, 3)
    if kind == "size":
        return y, y.shape
    if kind == "tuple-subclass":
        return Row((y, torch.arange(2)))
    if kind == "tuple-subclass-args":
        return Span(y, y)
    return Pair(y, [y, {"z": y}])


class Outputs(nn.Linear):
    def __init__(self, kind):
        super().__init__(4, 4)
        self.kind = kind

    def forward(self, x):
        return pack(self.kind, super().forward(x))


class NormOutputs(nn.BatchNorm1d):
    def __init__(self, kind):
        super().__init__(4)
        self.kind = kind

    def forward(self, x):
        return pack(self.kind, super().forward(x))


@pytest.mark.parametrize(
    "kind",
    [
        "max",
        "ordered",
        "model-output",
        "namedtuple",
        "list-subclass",
        "dataclass",
        "size",
        "tuple-subclass",
        "tuple-subclass-args",
    ],
)
@pytest.mark.parametrize("layer", ["recast", "norm"])
def test_hooks_keep_output_container_types(kind, layer):
    # the recast hook and a running-stat norm's hook cast outputs back to bf16
    if layer == "norm":
        model = cast_model(nn.Sequential(NormOutputs(kind)))
    else:
        model = cast_model(nn.Sequential(Outputs(kind)), full_precision_recast_layers=["0"])
    out = model(torch.randn(2, 4).bfloat16())
    if kind == "max":
        assert type(out) is torch.return_types.max
        assert out.values.dtype == torch.bfloat16
        assert out.indices.dtype == torch.int64
    elif kind == "ordered":
        assert type(out) is collections.OrderedDict
        assert list(out) == ["y", "n"]
        assert out["y"].dtype == torch.bfloat16
        assert out["n"].dtype == torch.int64
    elif kind == "model-output":
        assert type(out) is Output
        assert out.logits.dtype == torch.bfloat16
        assert out["logits"] is out.logits
    elif kind == "list-subclass":
        assert type(out) is Tagged
        assert out.tag == "kept"
        assert [t.dtype for t in out] == [torch.bfloat16, torch.int64]
    elif kind == "dataclass":
        assert type(out) is Result
        assert (out.y.dtype, out.n) == (torch.bfloat16, 3)
    elif kind == "size":
        # the torch.Size came back a plain tuple, without numel() (audit 2026-12-06)
        assert type(out) is tuple
        assert out[0].dtype == torch.bfloat16
        assert type(out[1]) is torch.Size
        assert out[1].numel() == 8
    elif kind == "tuple-subclass":
        assert type(out) is Row
        assert [t.dtype for t in out] == [torch.bfloat16, torch.int64]
    elif kind == "tuple-subclass-args":
        assert type(out) is tuple  # Span cannot be rebuilt from its items
        assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16]
    else:
        assert type(out) is Pair
        assert out.a.dtype == torch.bfloat16
        assert out.b[1]["z"].dtype == torch.bfloat16


def test_widened_inputs_keep_tuple_subclasses():
    """The input pre-hook rebuilt a torch.Size argument, or a tuple subclass holding tensors, as
    a plain tuple (audit 2026-12-06)."""
    seen = {}

    class Takes(nn.Linear):
        def forward(self, x, shape, row):
            seen["shape"], seen["row"] = shape, row
            return super().forward(x).reshape(shape)

    model = cast_model(nn.Sequential(Takes(4, 4)), full_precision_layers=["0"])
    x = torch.randn(2, 4).bfloat16()
    shape = torch.Size((4, 2))
    out = model[0](x, shape, row=Row((x, torch.arange(2))))
    assert seen["shape"] is shape
    assert type(seen["row"]) is Row
    assert [t.dtype for t in seen["row"]] == [torch.float32, torch.int64]
    assert torch.equal(seen["row"][0], x.float())
    assert out.shape == (4, 2)
    assert out.dtype == torch.float32


def test_tied_weight_conflict_is_refused():
    model = Net()
    with pytest.raises(ConfigError, match="shared with"):
        cast_model(model, full_precision_layers=["out"])
    # keeping both holders in full precision is consistent
    model = Net()
    cast_model(model, full_precision_layers=["out", "embed"])
    assert model.embed.weight.dtype == torch.float32
    assert model.out.weight is model.embed.weight


def test_bad_arguments():
    model = Net()
    with pytest.raises(ConfigError, match="fnmatch patterns"):
        cast_model(model, full_precision_layers=[3])
    with pytest.raises(ConfigError, match="floating torch dtype"):
        cast_model(model, dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"16 bits or more.*got torch.float8_e4m3fn"):
        cast_model(model, dtype=torch.float8_e4m3fn)
    assert model.head.weight.dtype == torch.float32  # refused before any cast
    with pytest.raises(ConfigError, match=r"^full_precision_layers takes .*got int 123"):
        cast_model(model, full_precision_layers=123)
    with pytest.raises(ConfigError, match=r"^full_precision_recast_layers takes .*got float"):
        cast_model(model, full_precision_recast_layers=1.5)
    with pytest.raises(ConfigError, match="matches both"):
        cast_model(model, full_precision_layers=["head"], full_precision_recast_layers=["head"])
    with pytest.warns(UserWarning, match="matches no module"):
        cast_model(Net(), full_precision_layers=["lm_head"])
    with pytest.warns(UserWarning, match="matches no module"):
        cast_model(Net(), full_precision_layers=[nn.Linear(2, 2)])


def test_recast_replaces_hooks_and_other_dtypes():
    model = Net()
    model.out.weight = nn.Parameter(torch.randn(11, 8))
    cast_model(model, full_precision_recast_layers=["head"])
    cast_model(model, full_precision_recast_layers=["head"])
    assert len(model.head._forward_pre_hooks) == 1
    assert len(model.head._forward_hooks) == 1
    assert len(model.bn._forward_pre_hooks) == 1
    cast_model(model, dtype=torch.float16)  # head is no longer listed: hooks gone, cast
    assert not model.head._forward_pre_hooks
    assert model.head.weight.dtype == torch.float16
    assert model.blocks[0].attn.weight.dtype == torch.float16


def test_float64_casts_every_module():
    """float32 layers in a float64 network would get float64 inputs (BatchNorm raised)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    cast_model(
        model, torch.float64, full_precision_layers=["2"], full_precision_recast_layers=["0"]
    )
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model[1].running_mean.dtype == torch.float64
    out = model(torch.randn(3, 4, dtype=torch.float64))
    assert out.dtype == torch.float64
    out.sum().backward()


def test_a_float64_model_cast_to_bf16_keeps_float32_layers():
    """A float64 model cast to bf16 left its full-precision layers and BatchNorm in float64,
    whose pre-hooks widen inputs to float32 only: the forward raised."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    cast_model(model, full_precision_layers=["2"])
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].running_var.dtype == model[2].weight.dtype == torch.float32
    assert model[1].num_batches_tracked.dtype == torch.int64
    assert model(torch.randn(3, 4, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("by", ["name", "module"])
@pytest.mark.parametrize("mode", ["full_precision_layers", "full_precision_recast_layers"])
def test_a_matched_container_hooks_the_modules_that_run(by, mode):
    """A ModuleList named in full_precision_layers got the input hook itself, and a ModuleList
    never runs: its fp32 heads took bf16 inputs and the forward raised."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 3))])
            self.norms = nn.ModuleDict({"a": nn.BatchNorm1d(4)})

        def forward(self, x):
            h = self.norms["a"](self.body(x))
            return [head(h) for head in self.heads]

    model = Heads()
    spec = "heads" if by == "name" else model.heads
    cast_model(model, **{mode: [spec]})
    assert model.heads[1][0].weight.dtype == torch.float32
    outs = model(torch.randn(3, 4, dtype=torch.bfloat16))
    want = torch.float32 if mode == "full_precision_layers" else torch.bfloat16
    assert [o.dtype for o in outs] == [want, want]
    assert not model.heads._forward_pre_hooks
    assert len(model.heads[1]._forward_pre_hooks) == 1  # the Sequential, not the Linear in it
    assert not model.heads[1][0]._forward_pre_hooks
    assert len(model.norms["a"]._forward_hooks) == 1  # BatchNorm's own hooks, once


def test_cast_model_pickles_and_trains_with_mixed_dtypes(device):
    torch.manual_seed(0)
    model = Net().to(device)
    cast_model(model, full_precision_layers=["head"])
    clone = pickle.loads(pickle.dumps(model))
    assert len(clone.bn._forward_pre_hooks) == 1
    opt = FlashAdamW(model.parameters(), lr=1e-2)  # bf16 and fp32 parameters in one optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head, logits = model(torch.randint(0, 11, (6,), device=device))
    (head.float().pow(2).mean() + logits.float().pow(2).mean()).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n
    assert opt.state[model.head.weight].get("master_code") is None  # fp32: its own master
    assert opt.state[model.decoder.proj.weight]["master_code"].dtype == torch.uint8
