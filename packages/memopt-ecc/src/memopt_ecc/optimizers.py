"""The ECC family: ``FlashSGD``, ``FlashSGDW``, ``FlashAdam``, ``FlashAdamW``, ``FlashLion``.

Each class is a :class:`memopt_core.MemOptimizer` with FlashOptim's constructor (same parameter
names, order and defaults) mapped onto core's formats:

=========================== ===================================================================
FlashOptim argument          memopt configuration
=========================== ===================================================================
``master_weight_bits=24``    bf16 parameters: master ``"ecc24"`` (bf16 + uint8 code, 16
                             significant bits); fp32 parameters keep their fp32 master
``master_weight_bits=32``    bf16 parameters: master ``"ecc32"`` (bf16 + int16 code, exactly fp32)
``master_weight_bits=None``  bf16/fp16 parameters are the weights (master ``"none"``)
``quantize=True``            moments ``"q8"`` (e4m3 first moment, e4m4 sqrt second moment, E8M0
                             scale per 32 elements: 1.03125 B per moment)
``quantize=False``           moments ``"fp32"`` (4 B per moment)
``fused=True``               a registered kernel backend when one supports the group (Triton on
                             CUDA, memopt-kernels-cpu on CPU), else core's torch backend; same bits
``fused=False``              always core's pure-torch reference backend (same bits, slower)
``compress_state_dict``      ``state_dict()`` keeps the compact codes (True) or decodes moments to
                             fp32 tensors shaped like the parameters (False)
``check_numerics``           non-finite gradients and updates below the master's resolution raise
                             :class:`~memopt_core.NumericsError` (see :func:`master_resolution`)
=========================== ===================================================================

plus memopt's ``stochastic_rounding`` (default True: the measured choice, docs/ecc.md), ``seed``
and ``capturable`` (FlashOptim has none): step counts on the device and no host synchronisation
in :meth:`step`, so the step can be captured in a CUDA graph, and a ``torch.amp.GradScaler``'s
unscale and inf-skip run inside the fused kernel (core's ``MemOptimizer(capturable=True)``;
CUDA with the Triton backend).

**``quantize=False`` deviates from FlashOptim on purpose.** FlashOptim's docstring says it keeps
states "in FP32", but its code stores them in the *parameter's* dtype (bf16 for bf16 parameters),
where a round-to-nearest second moment with beta2 = 0.999 cannot decay (docs/formats.md, "Long
runs"). memopt keeps them in fp32 (8 B/param for Adam), the debugging baseline the flag is for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from memopt_core import MemOptimizer, NumericsError, StateSpec, conversions, reference
from memopt_core.errors import ConfigError, StateDictError
from memopt_core.optimizer import RULES, check_bool
from memopt_core.plan import own_storage, padding_unit, round_up, state_key
from memopt_core.sharding import local_shard, max_over_shards
from memopt_core.state_dict_meta import saved_meta

__all__ = [
    "MASTER_WEIGHT_BITS",
    "FlashAdam",
    "FlashAdamW",
    "FlashLion",
    "FlashOptimizer",
    "FlashSGD",
    "FlashSGDW",
    "master_resolution",
    "significant_bits",
]

#: ``master_weight_bits`` -> core's master format for bfloat16 parameters
MASTER_WEIGHT_BITS: dict[int | None, str] = {24: "ecc24", 32: "ecc32", None: "none"}
_MOMENT_NAMES = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _master_for_bits(bits: Any) -> str:
    if (
        isinstance(bits, bool)
        or (bits is not None and not isinstance(bits, int))
        or bits not in MASTER_WEIGHT_BITS
    ):
        raise ConfigError(
            f"master_weight_bits must be 24 (bf16 + 8-bit code), 32 (bf16 + 16-bit code, exact "
            f"fp32) or None (no master: the bf16 parameter is the weight); got {bits!r}"
        )
    return MASTER_WEIGHT_BITS[bits]


def _moments_for_quantize(quantize: Any) -> str:
    check_bool("quantize (param group)", quantize)
    return "q8" if quantize else "fp32"


#: FlashOptim constructor arguments that are optimizer-wide here -> the attribute holding each
_FIXED_KEYS = {
    "compress_state_dict": "compress_state_dict",
    "fused": "fused",
    "check_numerics": "check_numerics",
    "seed": "seed",
    "capturable": "_capturable",
}


# ------------------------------------------------------------------------------ resolution
def significant_bits(master: str, param_dtype: torch.dtype, stochastic_rounding: bool) -> int:
    """Significant bits (implicit bit included) that decide whether an update survives.

    ``24`` for float32 parameters, ECC-32 and *any* master with stochastic rounding (SR keeps an
    update in expectation as long as the fp32 sum ``x + u`` differs from ``x``, so fp32's own
    rounding is the limit); with round-to-nearest ``16`` for ECC-24, ``8`` for bf16 and ``11``
    for fp16 parameters without a master.
    """
    if param_dtype == torch.float32 or master in ("fp32", "ecc32") or stochastic_rounding:
        return 24
    if master == "ecc24":
        return 16
    if master == "none":
        return 8 if param_dtype == torch.bfloat16 else 11
    raise ConfigError(f"unknown master format {master!r}")


def master_resolution(
    magnitude: float,
    master: str,
    param_dtype: torch.dtype = torch.bfloat16,
    stochastic_rounding: bool = True,
) -> float:
    """The spacing of the master format's grid at a weight of ``magnitude`` (its real resolution).

    ``resolution(M) = 2**(max(floor(log2 M), emin) - (p - 1))`` with ``p`` from
    :func:`significant_bits` and ``emin = -14`` for fp16 parameters rounded to nearest without a
    master, else ``-126``. An update ``u`` of a weight in ``M``'s binade is lost (the master does
    not change, not even in expectation) iff ``|u| < resolution(M) / 2``.
    """
    p = significant_bits(master, param_dtype, stochastic_rounding)
    emin = -14 if p == 11 else -126
    m = abs(float(magnitude))
    e = emin if m == 0.0 or not math.isfinite(m) else max(math.frexp(m)[1] - 1, emin)
    return math.ldexp(1.0, e - (p - 1))


# ------------------------------------------------------------------------------ base class
class FlashOptimizer(MemOptimizer):
    """Base of the ECC family (see the module doc for the argument mapping).

    Bytes of optimizer state per parameter element (:meth:`state_bytes` gives exact arena bytes;
    the bf16 parameter itself adds 2): master code 1 (``master_weight_bits=24``), 2 (32) or 0
    (None, or fp32 parameters); moments 1.03125 each with ``quantize=True``, 4 each without (Adam
    keeps two, Lion and SGD with momentum one, SGD without momentum none). Parameters: bfloat16
    (ECC or none), float16 (``master_weight_bits=None`` only) or float32, on CPU or CUDA; mixed
    dtypes in one optimizer are grouped internally; non-contiguous parameters are handled.

    Fused (``fused=True``, the default): one kernel launch per (dtype, format) group decodes the
    master and the moments, applies the rule (with a GradScaler's unscale and inf skip, with or
    without ``capturable``) and encodes them back, in one pass over memory: memopt-kernels-triton on
    CUDA, memopt-kernels-cpu on the CPU. Without them, or with ``fused=False``, core's pure-torch
    backend computes the same bits.

    While :func:`memopt_ecc.enable_gradient_release` is active, :meth:`step` and
    :meth:`zero_grad` do nothing and warn once per activation (core's switch, shared by every
    :class:`~memopt_core.MemOptimizer`). With ``check_numerics`` the resolution check runs before
    every update, from :meth:`step` and :meth:`step_parameters` (the release hooks) alike.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        rule: str,
        lr: float | Tensor,
        betas: tuple[float, float] | None = None,
        eps: float = 1e-8,
        weight_decay: float | Tensor = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        decouple_lr: bool = False,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        master = _master_for_bits(master_weight_bits)
        for name, value in (
            ("quantize", quantize),
            ("compress_state_dict", compress_state_dict),
            ("fused", fused),
        ):
            check_bool(name, value)
        if capturable is True and not fused:
            raise ConfigError(
                "capturable=True runs the fused Triton step with device-resident step counts; "
                "fused=False (core's torch backend) has none"
            )
        self.quantize = quantize
        self.master_weight_bits = master_weight_bits
        self.compress_state_dict = compress_state_dict
        self.fused = fused
        super().__init__(
            params,
            rule=rule,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            maximize=False,
            decouple_lr=decouple_lr,
            master=master,
            moments="q8" if quantize else "fp32",
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            check_numerics=check_numerics,
            backend=None if fused else "torch",
            capturable=capturable,
        )

    # ------------------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch semantics; a group may also set FlashOptim's ``master_weight_bits`` and
        ``quantize``, translated to core's ``master`` / ``moments``."""
        if isinstance(param_group, dict):
            group = dict(param_group)
            if "master_weight_bits" in group:
                if "master" in group:
                    raise ConfigError(
                        "a param group sets both master_weight_bits and master; set one"
                    )
                group["master"] = _master_for_bits(group.pop("master_weight_bits"))
            if "quantize" in group:
                if "moments" in group:
                    raise ConfigError("a param group sets both quantize and moments; set one")
                group["moments"] = _moments_for_quantize(group.pop("quantize"))
            self._check_flash_keys(group, f"param group {len(self.param_groups)}")
            # checked on a copy; then the caller's dict itself becomes the (translated) group,
            # as in torch, so that later edits through it take effect
            param_group.pop("master_weight_bits", None)
            param_group.pop("quantize", None)
            param_group.update(group)
        super().add_param_group(param_group)

    def _check_flash_keys(self, group: Mapping[str, Any], where: str) -> None:
        """Refuse FlashOptim keys in ``group`` that disagree with this optimizer: ``quantize`` and
        ``master_weight_bits`` are translated only when a group is added, and the others are
        optimizer-wide, so a value written into ``param_groups`` later would be ignored.
        ``master_bytewidth`` (FlashOptim's own record of the width) is never read: refused."""
        if "master_bytewidth" in group:
            raise ConfigError(
                f"{where} sets master_bytewidth={group['master_bytewidth']!r}, FlashOptim's "
                "internal record of the master width, which memopt does not read: set "
                "master_weight_bits (24 or 32, or None for no correction) when adding the group"
            )
        for key in _FIXED_KEYS:
            if key in group and group[key] != getattr(self, _FIXED_KEYS[key]):
                raise ConfigError(
                    f"{where} sets {key}={group[key]!r}, but {key} is a constructor argument of "
                    f"the whole optimizer, which runs with {key}="
                    f"{getattr(self, _FIXED_KEYS[key])!r}: build a new optimizer to change it"
                )
        for key, translate, core_key in (
            ("master_weight_bits", _master_for_bits, "master"),
            ("quantize", _moments_for_quantize, "moments"),
        ):
            if key in group and translate(group[key]) != group[core_key]:
                raise ConfigError(
                    f"{where} sets {key}={group[key]!r}, but its {core_key} is "
                    f"{group[core_key]!r}: FlashOptim's {key} is translated to {core_key} only "
                    "when a group is added, and formats cannot change in place: restore the old "
                    "value, or build a new optimizer (memopt_checkpoint converts saved states "
                    "between formats)"
                )

    # ------------------------------------------------------------------------------ stepping
    def _check_before_update(
        self, only: list[Tensor] | None, grads: Mapping[Tensor, Tensor] | None = None
    ) -> None:
        # core runs it before every update (step(), a replayed cached step, step_parameters())
        for gi, group in enumerate(self.param_groups):
            self._check_flash_keys(group, f"param group {gi}")
        if self.check_numerics:
            params = [p for g in self.param_groups for p in g["params"]] if only is None else only
            self._check_resolution(params, grads or {})

    # ---------------------------------------------------------------------- numerics check
    def _step_bound(self, group: Mapping[str, Any], gmax: float, mag: float) -> float:
        """An upper estimate of the gradient-driven step of the tensor's elements."""
        kind, decoupled = RULES[self.rule]
        lr = float(group["lr"])
        if kind in ("adam", "lion"):
            # Lion: exactly lr (a sign); Adam: |m_hat / (sqrt(v_hat) + eps)| <= 1 while the
            # gradient keeps its scale, so lr bounds its steady steps.
            return lr
        direction = gmax + (0.0 if decoupled else float(group["weight_decay"]) * mag)
        momentum = float(group["momentum"])
        if momentum > 0.0:
            if momentum >= 1.0:
                return math.inf
            direction *= abs(1.0 - float(group["dampening"])) / (1.0 - momentum)
        return lr * direction

    def _check_resolution(self, params: list[Tensor], grads: Mapping[Tensor, Tensor]) -> None:
        """Raise NumericsError when a step cannot change the largest weights of a tensor.
        ``grads`` (step_parameters' gradients) take precedence over ``p.grad``."""
        from memopt_core.fp32_state import _decode

        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        names = {}
        for group in self.param_groups:
            if group.get("param_names"):
                pairs = zip(group["params"], group["param_names"], strict=True)
                names.update({id(p): n for p, n in pairs})
        kind = RULES[self.rule][0]
        items: list[tuple[Tensor, Mapping[str, Any], Tensor]] = []
        seen: set[int] = set()
        for p in params:
            g: Mapping[str, Any] | None = groups.get(id(p)) if isinstance(p, Tensor) else None
            if g is None or id(p) in seen or p.numel() == 0:
                continue
            grad = grads.get(p)
            if grad is None:
                grad = p.grad
            if grad is None:
                continue
            seen.add(id(p))
            if float(g["lr"]) == 0.0:
                continue  # a dummy step is allowed
            items.append((p, g, grad.detach()))
        if not items:
            return
        by_device: dict[torch.device, list[tuple[Tensor, Mapping[str, Any], Tensor]]] = {}
        for p, g, grad in items:
            # (the largest finite |x| of the decoded master, the largest |g| or 0 where a
            # gradient is not finite, that flag), from one min-max reduction each (aminmax
            # keeps NaN and inf; on the CPU isfinite() and abs() took 20-50x as long), read
            # once per device. A sharded parameter's come from this process's shard (a
            # DTensor's .tolist() raised), then the maximum over its ranks: every rank decides
            # from the whole tensor, as one process does
            x, grad = local_shard(_decode(self, p, g)), local_shard(grad)
            if x.numel() == 0:  # a process holding none of the tensor
                stats = torch.zeros(3, dtype=torch.float32, device=x.device)
            else:
                xlo, xhi = torch.aminmax(x.nan_to_num(0.0, 0.0, 0.0))
                glo, ghi = (v.float() for v in torch.aminmax(grad))
                finite = torch.isfinite(glo) & torch.isfinite(ghi)
                gpeak = torch.where(finite, torch.maximum(ghi, -glo), 0.0)
                stats = torch.stack([torch.maximum(xhi, -xlo).float(), gpeak, (~finite).float()])
            by_device.setdefault(p.device, []).append((p, g, stats))
        bad: list[str] = []
        for entries in by_device.values():
            values = torch.stack([s for *_, s in entries])
            values = max_over_shards([p for p, *_ in entries], values)
            for (p, g, _), (mag, gabs, nonfinite) in zip(entries, values.tolist(), strict=True):
                if nonfinite:
                    continue  # core reports non-finite gradients
                gmax = gabs if kind == "sgd" else 0.0  # SGD's step: max |g|
                master = "fp32" if p.dtype == torch.float32 else g["master"]
                sr = bool(g["stochastic_rounding"])
                # at M = 2**k a step down lands on the finer grid below M and is not lost:
                # the spacing there is the one that decides (M's predecessor is below 2**k)
                res = master_resolution(math.nextafter(mag, 0.0), master, p.dtype, sr)
                step = self._step_bound(g, gmax, mag)
                if step == 0.0:
                    continue  # an all-zero gradient asks for no step (an unused parameter)
                if step < res / 2:
                    label = names.get(id(p))
                    what = f"{label!r}" if label else f"of shape {tuple(p.shape)}"
                    bad.append(
                        f"parameter {what} ({p.dtype}, master {master!r}, "
                        f"{'stochastic' if sr else 'nearest'} rounding): step <= {step:.3g} at "
                        f"lr {float(g['lr']):.3g}, but its largest weight {mag:.6g} has "
                        f"resolution {res:.3g} (updates below {res / 2:.3g} are lost)"
                    )
        if bad:
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise NumericsError(
                "check_numerics: an update is below the master format's resolution for "
                + "; ".join(bad[:8])
                + more
                + ". resolution(M) = 2**(floor(log2 M-) - (p - 1)) (M- just below M) with p = 24 "
                "(fp32, ECC-32 or "
                "stochastic rounding), 16 (ECC-24) or 8 (bf16, no master) significant bits. No "
                "parameter or state was modified; raise the learning rate, use "
                "master_weight_bits=32 or stochastic_rounding=True, or set check_numerics=False"
            )

    # ---------------------------------------------------------------------------- state dicts
    def _spec_of(self, group: Mapping[str, Any], p: Tensor) -> StateSpec:
        return StateSpec(
            master="fp32" if p.dtype == torch.float32 else group["master"],
            moments=group["moments"],
            stochastic_rounding=group["stochastic_rounding"],
        )

    def _local_state_dict(self) -> dict[str, Any]:
        """Core's state dict; with ``compress_state_dict=False`` every moment is decoded to an fp32
        tensor shaped like its parameter (master codes and steps keep their formats; core
        hands a sharded parameter's out as DTensors sharded like it). A decay-normalized second
        moment (q8, fp8: stored as ``u = v / N``) is handed out as Adam's ``v``, ``u`` times
        :meth:`~memopt_core.MemOptimizer.decay_norm` of its step, rounded once. Where moments were
        decoded, the entry is a snapshot: its other tensors are copies too (core's entries
        are live views, as torch's are)."""
        sd = super()._local_state_dict()
        sd["memopt"] = dict(sd["memopt"], compressed=self.compress_state_dict)
        if self.compress_state_dict:
            return sd
        state = sd["state"]
        for gi, (group, saved) in enumerate(
            zip(self.param_groups, sd["param_groups"], strict=True)
        ):
            for p, key in zip(group["params"], saved["params"], strict=True):
                if key not in state:
                    continue
                spec = self._spec_of(group, p)
                entry = dict(state[key])
                decoded = set()
                for name in _MOMENT_NAMES:
                    codec = spec.second if name == "exp_avg_sq" else spec.first
                    keys = {sfx: state_key(name, sfx) for sfx in codec.fields}
                    if codec.name == "fp32" or not all(k in entry for k in keys.values()):
                        continue
                    flat = conversions.decode_moment(
                        codec, {sfx: entry.pop(k) for sfx, k in keys.items()}
                    )
                    if name == "exp_avg_sq":  # stored as u = v / N (8-bit): hand out v
                        norm = self.decay_norm(gi, int(float(entry.get("step", 0))))
                        flat = conversions.denormalize_second_moment(flat, norm)
                    shard = local_shard(p)
                    entry[name] = own_storage(flat[: shard.numel()].reshape(shard.shape))
                    decoded.add(name)
                if decoded:
                    # the decoded moments are copies: so are the step count and master code
                    # beside them, else a dict held across steps mixes two steps' states
                    entry = {
                        k: v.clone() if isinstance(v, Tensor) and k not in decoded else v
                        for k, v in entry.items()
                    }
                state[key] = entry
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, compressed or not.

        Uncompressed moments (fp32 tensors shaped like their parameters) are encoded into this
        optimizer's format (round to nearest) first; decoding them gives exactly the values that
        were saved, so training resumes with the same bits as from the compressed dict. A
        decoded second moment is Adam's ``v``; where the format stores it decay-normalized (q8,
        fp8) it is divided by the ``N`` it was saved with (the saved ``memopt`` entry's
        ``decay_norm_beta2`` of its group and its step count, rounded toward zero) before it is
        encoded, so the stored ``u`` is the one the saving optimizer held. A dict without that
        list (state-dict version 1) holds ``v`` itself: it is encoded as it is, and the next
        step normalizes it (memopt-core).
        """
        super().load_state_dict(state_dict)

    def _prepare_loaded(self, sd: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(sd.get("state"), Mapping):
            return sd  # core explains what is wrong
        if _saved_by_flashoptim(sd):
            raise StateDictError(
                "this state dict was saved by FlashOptim (its groups hold master_bytewidth or "
                "its states error_bits), whose state formats memopt does not read: carry the "
                "weights over with FlashOptim's optimizer.get_fp32_model_state_dict(model) and "
                "this optimizer's set_fp32_model_state_dict(model, sd) (the moments start afresh)"
            )
        saved_groups = sd.get("param_groups")
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(
            self.param_groups
        ):
            return sd  # core explains what is wrong
        for gi, saved in enumerate(saved_groups):
            # the step refuses these keys where they disagree with the optimizer: refused here,
            # a load took them and every later step raised until another load
            if isinstance(saved, Mapping) and {"master", "moments"} <= saved.keys():
                try:
                    self._check_flash_keys(saved, f"param group {gi} of the state dict")
                except ConfigError as e:
                    raise StateDictError(str(e)) from None
        state = dict(sd["state"])
        changed = False
        norm_beta2 = self._saved_norm_beta2(sd)
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if not isinstance(saved, Mapping) or len(saved.get("params", ())) != len(
                group["params"]
            ):
                return sd
            for param, key in zip(group["params"], saved["params"], strict=True):
                entry = state.get(key)
                if not isinstance(entry, Mapping):
                    continue
                p = local_shard(param)  # a sharded parameter's state is its shard's
                sr = saved.get("stochastic_rounding", True)
                if not isinstance(sr, bool):  # bool() of a tensor of two was a RuntimeError
                    return sd  # core names it
                try:
                    spec = StateSpec(
                        master="fp32" if p.dtype == torch.float32 else saved["master"],
                        moments=saved["moments"],
                        stochastic_rounding=sr,
                    )
                except (KeyError, ConfigError):
                    return sd
                new = dict(entry)
                for name in _MOMENT_NAMES:
                    codec = spec.second if name == "exp_avg_sq" else spec.first
                    t = new.get(name)
                    if codec.name == "fp32" or not isinstance(t, Tensor):
                        continue
                    fits = t.dtype == torch.float32 and tuple(t.shape) == tuple(p.shape)
                    if any(state_key(name, sfx) in new for sfx in codec.fields if sfx):
                        if fits:
                            raise StateDictError(
                                f"the state of parameter index {key!r} holds {name!r} both "
                                "decoded (fp32) and encoded; keep one"
                            )
                        continue  # encoded: core checks its layout
                    if t.dtype == codec.fields[""].dtype:
                        continue  # codes without their other fields: core names those
                    if not fits:
                        raise StateDictError(
                            f"state {name!r} of parameter index {key!r} is {t.dtype} of shape "
                            f"{tuple(t.shape)}; a decoded moment (compress_state_dict=False) "
                            f"must be torch.float32 of the parameter's shape {tuple(p.shape)}"
                        )
                    if name == "exp_avg_sq":  # q8 would store a negative v as its NaN code
                        conversions.check_second_moment(
                            t, f"state {name!r} of parameter index {key!r}"
                        )
                    padded = round_up(p.numel(), padding_unit(spec))
                    flat = torch.zeros(padded, dtype=torch.float32, device=t.device)
                    flat[: p.numel()] = t.reshape(-1)
                    if name == "exp_avg_sq" and spec.decay_normalized:  # v -> u = v / N
                        norm = _saved_norm(norm_beta2, gi, new.get("step"))
                        flat = conversions.normalize_second_moment(flat, norm)
                    del new[name]
                    for sfx, value in conversions.encode_moment(codec, flat).items():
                        new[state_key(name, sfx)] = value
                    changed = True
                state[key] = new
        if not changed:
            return sd
        out = dict(sd)
        out["state"] = state
        return out

    def _saved_norm_beta2(self, sd: Mapping[str, Any]) -> dict[int, float] | None:
        """The normalizing beta2 of each group of the saved dict ``sd``, as core's
        ``load_state_dict`` records it from the dict's ``memopt`` entry (its
        ``decay_norm_beta2`` list; 0.0, whose second moments are ``v`` itself, for a group the
        list gives None and for every group of a dict without it). None where the entry is
        malformed: core's checks explain it."""
        try:
            return self._checked_norm_meta(saved_meta(sd), sd.get("param_groups"))
        except StateDictError:
            return None

    # ---------------------------------------------------------------- FlashOptim's methods
    def recompute_param_stats(self) -> None:
        """FlashOptim's: refresh the cached weight statistics ``check_numerics`` compares with.
        Here a no-op: the check reads the current weights at every step (docs/ecc.md)."""

    def step_param(self, p: Tensor, group: Mapping[str, Any] | None = None) -> None:
        """FlashOptim's one-parameter step: :meth:`step_parameters` ``([p])``. ``group``, if
        given, must be ``p``'s param group (its hyperparameters are what the step uses)."""
        if group is not None and not any(q is p for q in group.get("params", ())):
            raise ConfigError(
                "step_param(p, group): p is not in that group; the step uses p's own group"
            )
        self.step_parameters([p])

    # ------------------------------------------------------------------------ fp32 weights
    def get_fp32_model_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """FlashOptim's method form of :func:`memopt_ecc.get_fp32_model_state_dict`."""
        from memopt_core.fp32_state import get_fp32_model_state_dict

        return get_fp32_model_state_dict(model, self)

    def set_fp32_model_state_dict(
        self, model: torch.nn.Module, fp32_state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """FlashOptim's method form of :func:`memopt_ecc.set_fp32_model_state_dict`."""
        from memopt_core.fp32_state import set_fp32_model_state_dict

        set_fp32_model_state_dict(model, self, fp32_state_dict, strict=strict)

    # ---------------------------------------------------------------------- pickle, deepcopy
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(
            quantize=self.quantize,
            master_weight_bits=self.master_weight_bits,
            compress_state_dict=self.compress_state_dict,
            fused=self.fused,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("quantize", True)
        self.__dict__.setdefault("master_weight_bits", 24)
        self.__dict__.setdefault("compress_state_dict", True)
        self.__dict__.setdefault("fused", True)


# ------------------------------------------------------------------------------ the family
class FlashSGD(FlashOptimizer):
    """SGD with L2 weight decay (``torch.optim.SGD`` semantics, first momentum step ``buf = g``).

    State bytes per element: code 1 / 2 / 0 (``master_weight_bits`` 24 / 32 / None) plus, with
    ``momentum > 0``, 1.03125 (``quantize=True``) or 4; bf16, fp16 (no master) or fp32
    parameters, CPU or CUDA. Unlike FlashOptim (which dampens the first momentum step too), the
    first step follows torch: ``buf = g``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | Tensor = 0.0,
        nesterov: bool = False,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            rule="sgd",
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            quantize=quantize,
            compress_state_dict=compress_state_dict,
            master_weight_bits=master_weight_bits,
            check_numerics=check_numerics,
            fused=fused,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            capturable=capturable,
        )


class FlashSGDW(FlashOptimizer):
    """SGD with decoupled weight decay (``p *= 1 - lr*wd``, or ``1 - lr/initial_lr*wd`` with
    ``decouple_lr``). Bytes, dtypes and devices as :class:`FlashSGD`; fused as every
    :class:`FlashOptimizer`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | Tensor = 0.0,
        nesterov: bool = False,
        decouple_lr: bool = False,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            rule="sgdw",
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            decouple_lr=decouple_lr,
            quantize=quantize,
            compress_state_dict=compress_state_dict,
            master_weight_bits=master_weight_bits,
            check_numerics=check_numerics,
            fused=fused,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            capturable=capturable,
        )


class FlashAdam(FlashOptimizer):
    """Adam with L2 weight decay (``torch.optim.Adam`` semantics).

    State bytes per element: code 1 / 2 / 0 (``master_weight_bits`` 24 / 32 / None) plus moments
    2.0625 (``quantize=True``) or 8: the default bf16 configuration holds 3.0625 B of state next
    to the 2 B parameter. bf16, fp16 (no master) or fp32 parameters, CPU or CUDA.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | Tensor = 0.0,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            rule="adam",
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            quantize=quantize,
            compress_state_dict=compress_state_dict,
            master_weight_bits=master_weight_bits,
            check_numerics=check_numerics,
            fused=fused,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            capturable=capturable,
        )


class FlashAdamW(FlashOptimizer):
    """AdamW (``torch.optim.AdamW`` semantics; ``decouple_lr`` decays by ``lr/initial_lr*wd``).

    State bytes per element: code 1 / 2 / 0 (``master_weight_bits`` 24 / 32 / None) plus moments
    2.0625 (``quantize=True``) or 8: the default bf16 configuration holds 3.0625 B of state next
    to the 2 B parameter. bf16, fp16 (no master) or fp32 parameters, CPU or CUDA.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | Tensor = 1e-2,
        decouple_lr: bool = False,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            rule="adamw",
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decouple_lr=decouple_lr,
            quantize=quantize,
            compress_state_dict=compress_state_dict,
            master_weight_bits=master_weight_bits,
            check_numerics=check_numerics,
            fused=fused,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            capturable=capturable,
        )


class FlashLion(FlashOptimizer):
    """Lion (Chen et al. 2023) with decoupled weight decay.

    State bytes per element: code 1 / 2 / 0 (``master_weight_bits`` 24 / 32 / None) plus one
    moment, 1.03125 (``quantize=True``) or 4. bf16, fp16 (no master) or fp32 parameters, CPU or
    CUDA.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float | Tensor = 0.0,
        decouple_lr: bool = False,
        quantize: bool = True,
        compress_state_dict: bool = True,
        master_weight_bits: int | None = 24,
        check_numerics: bool = False,
        fused: bool = True,
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        capturable: bool = False,
    ) -> None:
        super().__init__(
            params,
            rule="lion",
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            decouple_lr=decouple_lr,
            quantize=quantize,
            compress_state_dict=compress_state_dict,
            master_weight_bits=master_weight_bits,
            check_numerics=check_numerics,
            fused=fused,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            capturable=capturable,
        )


def _saved_norm(norm_beta2: Mapping[int, float] | None, gi: int, step: Any) -> float:
    """``N`` a decoded second moment of saved param group ``gi`` at ``step`` was
    denormalized with: ``reference.decay_norm`` of the group's normalizing beta2
    (:meth:`FlashOptimizer._saved_norm_beta2`). 1.0 where the dict is malformed (no such group,
    a step that is not a whole number >= 0): nothing is loaded then, core's checks say why."""
    count = conversions.saved_step_count(step)
    if norm_beta2 is None or gi not in norm_beta2 or count is None:
        return 1.0
    return reference.decay_norm(norm_beta2[gi], count)


def _saved_by_flashoptim(sd: Mapping[str, Any]) -> bool:
    """Whether ``sd`` has FlashOptim's own keys (per group ``master_bytewidth``, per parameter
    ``error_bits``), which no memopt or torch optimizer writes."""
    groups = sd.get("param_groups")
    if isinstance(groups, (list, tuple)) and any(
        isinstance(g, Mapping) and "master_bytewidth" in g for g in groups
    ):
        return True
    return any(isinstance(e, Mapping) and "error_bits" in e for e in sd["state"].values())
