"""The reference decoders refuse fields they would misread: another dtype (reinterpreted as
bit patterns, not converted), a scale count that does not match the codes, a missing field or
code; each a FormatError naming the field."""

from __future__ import annotations

import pytest
import torch

from memopt_core.errors import FormatError
from memopt_core.formats import MOMENT_FORMATS, master_codec, moment_codec


@pytest.mark.parametrize("name", MOMENT_FORMATS)
def test_moment_fields_are_checked(name):
    codec = moment_codec(name)
    fields = codec.encode(torch.rand(64))  # >= 0: q8_sqrt holds square roots
    assert torch.equal(codec.decode(fields).isnan(), torch.zeros(64, dtype=torch.bool))
    main = fields[""]
    other = torch.float32 if main.dtype != torch.float32 else torch.bfloat16
    with pytest.raises(FormatError, match=f"field '' of format '{name}' must be a {main.dtype}"):
        codec.decode({**fields, "": main.to(other)})
    if "scale" in fields:
        with pytest.raises(FormatError, match=r"field 'scale' .* holds 1 entries; 64 elements"):
            codec.decode({**fields, "scale": fields["scale"][:1]})
        with pytest.raises(FormatError, match=r"missing \['scale'\]"):
            codec.decode({"": main})
        with pytest.raises(FormatError, match="stores whole blocks of 32"):
            codec.decode({"": main[:33], "scale": fields["scale"][:1]})


def test_bf16_moments_of_float32_are_not_read_as_twice_as_many():
    with pytest.raises(FormatError, match=r"must be a torch.bfloat16 tensor, got torch.float32"):
        moment_codec("bf16").decode({"": torch.ones(4)})


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("none", torch.bfloat16),
        ("ecc24", torch.bfloat16),
        ("ecc32", torch.bfloat16),
    ],
)
def test_master_arguments_are_checked(name, dtype):
    codec = master_codec(name, dtype)
    param, code = codec.encode(torch.randn(32))
    assert torch.equal(codec.decode(param, code).isnan(), torch.zeros(32, dtype=torch.bool))
    wrong = torch.float16 if dtype != torch.float16 else torch.float32
    with pytest.raises(FormatError, match=f"decodes a {dtype} parameter, got {wrong}"):
        codec.decode(param.to(wrong), code)
    if code is None:
        with pytest.raises(FormatError, match="has no code"):
            codec.decode(param, torch.zeros(32, dtype=torch.uint8))
        return
    with pytest.raises(FormatError, match="together with its code; got None"):
        codec.decode(param, None)
    with pytest.raises(FormatError, match="the code holds 5 entries for 32 elements"):
        codec.decode(param, code[:5])
    with pytest.raises(FormatError, match=f"takes a {code.dtype} code, got torch.float32"):
        codec.decode(param, code.float())
