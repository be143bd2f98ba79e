"""A plain-torch replica of transformers' Qwen2 causal LM, for hosts without ``transformers``.

Same architecture, parameter names, shapes, initialization and arithmetic as
``transformers.Qwen2ForCausalLM`` (5.x, ``attn_implementation="sdpa"``, no padding mask, no KV
cache): token embedding; per layer an RMSNorm, grouped-query attention (q/k/v projections with
bias, o without, rotary embeddings on q and k, ``scaled_dot_product_attention(is_causal=True,
enable_gqa=True)``), a residual add, a second RMSNorm and a SwiGLU MLP (gate, up and down without
bias), another residual add; a final RMSNorm and an LM head tied to the embedding. RMSNorm works
in fp32 and multiplies its weight with the result cast back to the input dtype, as transformers'
does, so the same dtypes flow under bf16 autocast and in a bf16 model.

With ``QWEN25_05B`` the model has Qwen2.5-0.5B's shape: 290 parameter tensors, 494,032,768
parameters (DESIGN section 7). Initialization follows transformers' ``_init_weights``: linear and
embedding weights normal(0, 0.02), biases zero, norm weights one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen2Shape:
    """The fields of ``transformers.Qwen2Config`` that the architecture uses (same names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def with_layers(self, layers: int | None) -> Qwen2Shape:
        """The same shape with ``layers`` decoder layers (unchanged for None)."""
        return self if layers is None else replace(self, num_hidden_layers=layers)

    def config_kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``transformers.Qwen2Config`` for this shape."""
        return asdict(self)


#: Qwen2.5-0.5B (DESIGN section 7): 290 tensors, 494,032,768 parameters with 24 layers.
QWEN25_05B = Qwen2Shape(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
)

#: A toy of the same architecture for CPU smoke runs (GQA with 2 query heads per KV head).
TINY = Qwen2Shape(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
)


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Qwen2RotaryEmbedding(nn.Module):
    """cos and sin of the default RoPE (no scaling), in the dtype of the hidden states."""

    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        dim = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Qwen2Attention(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.head_dim = shape.head_dim
        self.num_key_value_groups = shape.num_attention_heads // shape.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        hidden, q_out = shape.hidden_size, shape.num_attention_heads * self.head_dim
        kv_out = shape.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=True)
        self.k_proj = nn.Linear(hidden, kv_out, bias=True)
        self.v_proj = nn.Linear(hidden, kv_out, bias=True)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            scale=self.scaling,
            is_causal=query.shape[2] > 1,
            enable_gqa=self.num_key_value_groups > 1,
        )
        out = out.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        hidden, inner = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(shape)
        self.mlp = Qwen2MLP(shape)
        self.input_layernorm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class Qwen2Model(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(shape) for _ in range(shape.num_hidden_layers)
        )
        self.norm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(shape)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class Qwen2ForCausalLM(nn.Module):
    """``forward(input_ids)`` returns the logits, shape (batch, sequence, vocab)."""

    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Qwen2Model(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter, as transformers
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' ``_init_weights``: N(0, initializer_range) weights, zero biases, unit
        norms."""
        if self.lm_head.weight.is_meta:
            return  # shapes only (nothing to draw)
        std = self.shape.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Qwen2RMSNorm):
                module.weight.fill_(1.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
