"""Reference update rules: the semantics every backend reproduces bit for bit.

Each rule is a pure function over fp32 (or fp64) tensors that returns new tensors and never
modifies its inputs. It is written with elementary, individually rounded torch operations
(``+ - * /`` and a correctly rounded square root), in the fixed order documented on each function,
with no fused multiply-add anywhere: a C++ or Triton kernel that performs the same operations in
the same order produces the same bits (DESIGN section 4, "Exactness in practice").

Hyperparameters enter through a scalars object built by :func:`adam_scalars`,
:func:`sgd_scalars` or :func:`lion_scalars`. Those functions do their arithmetic once, in Python
doubles; a backend rounds each field to the compute dtype exactly once (``to_compute``), so every
backend multiplies by the same fp32 numbers.

Semantics: SGD/SGDW, Adam/AdamW match ``torch.optim.SGD``/``Adam``/``AdamW`` (foreach=False)
except that torch fuses some multiply-adds (``lerp``, ``addcmul``, ``addcdiv``, ``add(alpha=)``):
they agree within a few ulps per step, not bit for bit. Lion follows the Lion paper (Chen et
al. 2023). ``maximize`` negates the gradient first; ``decouple_lr`` scales decoupled weight decay by
``lr / initial_lr`` (FlashOptim's convention) instead of ``lr``.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = [
    "DEVICE_STEP_LIMIT",
    "AdamScalars",
    "LionScalars",
    "SGDScalars",
    "adam",
    "adam_bias_last",
    "adam_bias_table",
    "adam_scalars",
    "bias_correction_table",
    "correctly_rounded_sqrt",
    "decay_factor",
    "decay_norm",
    "decay_norm_period",
    "decay_norm_table",
    "lion",
    "lion_scalars",
    "round_to_float32",
    "sgd",
    "sgd_scalars",
    "to_compute",
]


def correctly_rounded_sqrt(x: Tensor) -> Tensor:
    """IEEE square root, correctly rounded in ``x.dtype``.

    torch's float32 ``sqrt`` on the CPU is not correctly rounded (about 16% of results are one ulp
    off on AVX-512 builds). The square root of the exact fp64 value rounded once to fp32 is the
    correctly rounded fp32 square root (fp64 carries more than 2*24+2 bits, so double rounding is
    innocuous), which is what ``sqrt.rn`` gives on the GPU.
    """
    if x.dtype == torch.float64:
        return torch.sqrt(x)
    return torch.sqrt(x.double()).to(x.dtype)


def decay_factor(lr: float, weight_decay: float, initial_lr: float | None) -> float:
    """Multiplier of decoupled weight decay, in double: ``1 - lr*wd`` or ``1 - (lr/initial_lr)*wd``."""
    if initial_lr is None:
        return 1.0 - lr * weight_decay
    if initial_lr <= 0.0:
        raise ValueError(f"decouple_lr needs a positive initial lr, got {initial_lr}")
    return 1.0 - (lr / initial_lr) * weight_decay


@dataclass(frozen=True)
class AdamScalars:
    """Per-step scalars of Adam/AdamW, computed in double.

    ``step_size = lr / (1 - beta1**step)``, ``bc2_sqrt = sqrt(1 - beta2**step)``,
    ``one_minus_beta1 = 1 - beta1``, ``one_minus_beta2 = 1 - beta2``, ``decay`` multiplies the
    parameter (1.0 when there is no decoupled decay), ``l2`` is Adam's coupled weight decay.
    """

    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    step_size: float
    bc2_sqrt: float
    decay: float
    l2: float
    maximize: bool


@dataclass(frozen=True)
class SGDScalars:
    """Per-step scalars of SGD/SGDW: ``one_minus_dampening = 1 - dampening``."""

    lr: float
    momentum: float
    one_minus_dampening: float
    nesterov: bool
    decay: float
    l2: float
    maximize: bool


@dataclass(frozen=True)
class LionScalars:
    """Per-step scalars of Lion."""

    lr: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    decay: float
    maximize: bool


def adam_scalars(
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool,
    maximize: bool = False,
    initial_lr: float | None = None,
    normalized: bool = False,
) -> AdamScalars:
    """Scalars of Adam (``decoupled=False``, L2 decay) or AdamW (``decoupled=True``) at ``step``
    (1-based). ``normalized``: the second moment is stored divided by :func:`decay_norm`
    (``u = v / N``, the 8-bit formats), so the rule's ``v`` line updates ``u`` and its ``d``
    line divides ``sqrt(u)`` by ``bc2_sqrt / sqrt(N)``: with ``j = step % P`` (``P`` =
    :func:`decay_norm_period`), ``beta2`` is 1.0 (``j != 0``) or ``beta2**P`` (``j == 0``, where
    ``N`` returns to 1), ``one_minus_beta2 = (1 - beta2) / N`` and ``bc2_sqrt =
    sqrt(1 - beta2**step) / sqrt(N)``, each in double. A step with a zero gradient then leaves
    ``u`` exactly as it was on ``P - 1`` of every ``P`` steps: no re-rounding, so a decaying
    ``v`` does not random-walk (docs/formats.md, "Decay-normalized second moments")."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    beta1, beta2 = betas
    b2, omb2, bc2 = beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step)
    if normalized:
        period, norms, roots = decay_norm_table(beta2)
        j = step % period
        b2 = 1.0 if j else beta2**period
        omb2, bc2 = omb2 / norms[j], bc2 / roots[j]
    return AdamScalars(
        one_minus_beta1=1.0 - beta1,
        beta2=b2,
        one_minus_beta2=omb2,
        eps=eps,
        step_size=lr / (1.0 - beta1**step),
        bc2_sqrt=bc2,
        decay=decay_factor(lr, weight_decay, initial_lr) if decoupled else 1.0,
        l2=0.0 if decoupled else weight_decay,
        maximize=maximize,
    )


#: How far :func:`decay_norm` falls within a period: ``beta2**P >= 2**-8``, so a normalized
#: second moment is at most 256 times ``v`` (and ``one_minus_beta2 / N`` at most 256 times
#: ``1 - beta2``)
_NORM_FLOOR = 2.0**-8
#: The longest period: ``beta2`` within about 1e-5 of 1 re-rounds a pure decay once in 65536 steps
_NORM_MAX_PERIOD = 1 << 16


@functools.lru_cache(maxsize=64)
def decay_norm_period(beta2: float) -> int:
    """``P``: the largest count in ``[1, 65536]`` with ``beta2**P >= 2**-8`` (1 for ``beta2``
    below ``2**-8``, where a normalized second moment is a plain one). ``ValueError`` outside
    [0, 1)."""
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must lie in [0, 1), got {beta2!r}")
    if beta2 < _NORM_FLOOR:
        return 1
    period = min(_NORM_MAX_PERIOD, max(1, int(math.log(_NORM_FLOOR) / math.log(beta2))))
    while period > 1 and beta2**period < _NORM_FLOOR:  # log rounding
        period -= 1
    while period < _NORM_MAX_PERIOD and beta2 ** (period + 1) >= _NORM_FLOOR:
        period += 1
    return period


@functools.lru_cache(maxsize=8)
def decay_norm_table(beta2: float) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """``(P, N, R)``: :func:`decay_norm_period` and, for ``j`` in ``0..P-1``, ``N[j] =
    beta2**j`` and ``R[j] = math.sqrt(N[j])`` in double (a capturable step reads them on the
    device by ``j = step % P``)."""
    period = decay_norm_period(beta2)
    norms = tuple(beta2**j for j in range(period))
    return period, norms, tuple(math.sqrt(n) for n in norms)


def decay_norm(beta2: float, step: int) -> float:
    """``N = beta2**(step % P)``: a normalized second moment ``u`` (the 8-bit formats, see
    :func:`adam_scalars`) after ``step`` steps stands for ``v = u * N``. 1.0 at step 0."""
    period, norms, _ = decay_norm_table(beta2)
    return norms[step % period]


#: Step counts a device step (``capturable=True``) represents: float32 counters are exact below
#: 2**24, as torch's capturable step counters.
DEVICE_STEP_LIMIT = 2**24
#: ``beta**k`` below this makes ``1.0 - beta**k`` exactly 1.0 in double (half of 2**-54, the
#: rounding threshold, so a pow that is off by an ulp cannot cross it)
_SATURATED = 2.0**-55


@functools.lru_cache(maxsize=32)
def adam_bias_table(beta1: float, beta2: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Adam's bias corrections for every step a device step can take: ``(bc1, bc2_sqrt)`` with
    ``bc1[k] = 1.0 - beta1**k`` and ``bc2_sqrt[k] = math.sqrt(1.0 - beta2**k)``, in double, the
    arithmetic :func:`adam_scalars` does at step ``k`` (so ``step_size = lr / bc1[k]`` and
    ``bc2_sqrt[k]`` are its fields bit for bit).

    The tables end at the first ``K`` with ``beta**K < 2**-55`` for both betas (about 38,000
    entries for beta2 = 0.999), where both corrections are exactly 1.0 (they become 1.0
    earlier, at ``beta**k <= 2**-54``): entry ``K`` holds for every
    later step, so a device step reads entry ``min(k, K)``. ``K`` is at most
    :data:`DEVICE_STEP_LIMIT`; betas closer to 1 raise ``ValueError``."""
    last = adam_bias_last(beta1, beta2)
    return bias_correction_table(beta1, last), bias_correction_table(beta2, last, root=True)


@functools.lru_cache(maxsize=64)  # a capturable step asks at every step
def adam_bias_last(beta1: float, beta2: float) -> int:
    """The last index ``K`` of :func:`adam_bias_table` ``(beta1, beta2)``; ``ValueError`` for
    betas outside [0, 1) or so close to 1 that ``K`` would pass :data:`DEVICE_STEP_LIMIT`."""
    for b in (beta1, beta2):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas must lie in [0, 1), got {b!r}")
    last = 1
    for b in (beta1, beta2):
        if b > 0.0:
            last = max(last, math.ceil(math.log(_SATURATED) / math.log(b)))
    while beta1**last >= _SATURATED or beta2**last >= _SATURATED:  # log rounding
        last += 1
    if last > DEVICE_STEP_LIMIT:
        raise ValueError(
            f"betas {(beta1, beta2)} keep Adam's bias correction below 1 past step "
            f"{DEVICE_STEP_LIMIT} (2**24), the limit of device step counters; use betas further "
            "from 1 or capturable=False"
        )
    return last


@functools.lru_cache(maxsize=8)
def bias_correction_table(beta: float, last: int, root: bool = False) -> tuple[float, ...]:
    """``1.0 - beta**k`` (``root``: its ``math.sqrt``) for ``k`` in ``0..last``, in double, one of
    :func:`adam_bias_table`'s two tables. From the first ``k`` with ``beta**k < 2**-55`` on every
    entry is exactly 1.0, and is written so without its pow: a beta far from 1 costs its own few
    hundred pows, not the other beta's tens of thousands (a scheduler that cycles beta1, as
    ``OneCycleLR`` does, needs a new beta1 table at every step)."""
    out: list[float] = []
    for k in range(last + 1):
        x = beta**k
        if x < _SATURATED:
            out.extend([1.0] * (last + 1 - k))
            break
        out.append(math.sqrt(1.0 - x) if root else 1.0 - x)
    return tuple(out)


def sgd_scalars(
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
    initial_lr: float | None = None,
) -> SGDScalars:
    """Scalars of SGD (``decoupled=False``, L2 decay) or SGDW (``decoupled=True``)."""
    return SGDScalars(
        lr=lr,
        momentum=momentum,
        one_minus_dampening=1.0 - dampening,
        nesterov=nesterov,
        decay=decay_factor(lr, weight_decay, initial_lr) if decoupled else 1.0,
        l2=0.0 if decoupled else weight_decay,
        maximize=maximize,
    )


def lion_scalars(
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float = 0.0,
    maximize: bool = False,
    initial_lr: float | None = None,
) -> LionScalars:
    """Scalars of Lion (decoupled weight decay, as in the paper)."""
    beta1, beta2 = betas
    return LionScalars(
        lr=lr,
        beta1=beta1,
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        decay=decay_factor(lr, weight_decay, initial_lr),
        maximize=maximize,
    )


def to_compute(value: float, like: Tensor) -> Tensor:
    """``value`` rounded once to ``like``'s dtype, as a 0-d tensor on ``like``'s device."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def round_to_float32(value: float) -> float:
    """``value`` rounded once to fp32 (nearest even; past the largest float an infinity), as
    :func:`to_compute` rounds it for a float32 tensor, as a Python float and without creating a
    tensor: C's double -> float cast through ``struct`` (the kernels' launches convert their
    scalars with it at every step)."""
    value = float(value)
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _scalars_as(s, like: Tensor) -> dict:
    # Floats become 0-d tensors of the compute dtype (rounded once); flags stay Python bools.
    return {
        f.name: (
            getattr(s, f.name)
            if isinstance(getattr(s, f.name), bool)
            else to_compute(getattr(s, f.name), like)
        )
        for f in fields(s)
    }


def _check_compute(*tensors: Tensor) -> None:
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"reference rules compute in float32 or float64, got {dtype}")
    for t in tensors:
        if t.dtype != dtype or t.shape != tensors[0].shape:
            raise ValueError(
                f"reference rules need tensors of one dtype and shape, got {t.dtype}{tuple(t.shape)}"
                f" next to {dtype}{tuple(tensors[0].shape)}"
            )


def adam(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, s: AdamScalars
) -> tuple[Tensor, Tensor, Tensor]:
    """One Adam/AdamW step; returns ``(p, m, v)``. ``m`` and ``v`` are zero before the first step.

    Order (each line individually rounded, left to right)::

        g = -g                              if maximize
        g = g + l2 * p                      if l2 != 0       (Adam's L2 decay)
        p = p * decay                       if decay != 1    (AdamW's decoupled decay)
        m = m + one_minus_beta1 * (g - m)
        v = beta2 * v + one_minus_beta2 * (g * g)
        d = sqrt(v) / bc2_sqrt + eps        (correctly rounded sqrt)
        p = p - step_size * (m / d)
    """
    _check_compute(p, g, m, v)
    c = _scalars_as(s, p)
    if s.maximize:
        g = -g
    if s.l2 != 0.0:
        g = g + c["l2"] * p
    if s.decay != 1.0:
        p = p * c["decay"]
    m = m + c["one_minus_beta1"] * (g - m)
    v = c["beta2"] * v + c["one_minus_beta2"] * (g * g)
    d = correctly_rounded_sqrt(v) / c["bc2_sqrt"] + c["eps"]
    p = p - c["step_size"] * (m / d)
    return p, m, v


def sgd(
    p: Tensor, g: Tensor, buf: Tensor | None, s: SGDScalars, *, first_step: bool
) -> tuple[Tensor, Tensor | None]:
    """One SGD/SGDW step; returns ``(p, buf)`` (``buf`` is None without momentum).

    Order::

        g = -g                              if maximize
        g = g + l2 * p                      if l2 != 0       (SGD's L2 decay)
        p = p * decay                       if decay != 1    (SGDW's decoupled decay)
        buf = g                             on the first step (momentum != 0)
        buf = momentum * buf + one_minus_dampening * g        afterwards
        d = g + momentum * buf              if nesterov, else d = buf (or g without momentum)
        p = p - lr * d
    """
    _check_compute(p, g, *(() if buf is None else (buf,)))
    c = _scalars_as(s, p)
    if s.maximize:
        g = -g
    if s.l2 != 0.0:
        g = g + c["l2"] * p
    if s.decay != 1.0:
        p = p * c["decay"]
    if s.momentum != 0.0:
        if first_step or buf is None:
            buf = g.clone()
        else:
            buf = c["momentum"] * buf + c["one_minus_dampening"] * g
        d = g + c["momentum"] * buf if s.nesterov else buf
    else:
        d = g
    p = p - c["lr"] * d
    return p, buf if s.momentum != 0.0 else None


def lion(p: Tensor, g: Tensor, m: Tensor, s: LionScalars) -> tuple[Tensor, Tensor]:
    """One Lion step; returns ``(p, m)``.

    Order::

        g = -g                              if maximize
        p = p * decay                       if decay != 1
        u = beta1 * m + one_minus_beta1 * g
        p = p - lr * sign(u)                (sign(0) = 0)
        m = beta2 * m + one_minus_beta2 * g
    """
    _check_compute(p, g, m)
    c = _scalars_as(s, p)
    if s.maximize:
        g = -g
    if s.decay != 1.0:
        p = p * c["decay"]
    u = c["beta1"] * m + c["one_minus_beta1"] * g
    p = p - c["lr"] * torch.sign(u)
    m = c["beta2"] * m + c["one_minus_beta2"] * g
    return p, m
