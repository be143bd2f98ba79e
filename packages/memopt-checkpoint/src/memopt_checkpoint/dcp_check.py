"""``check_dcp_load``: the checks ``torch.distributed.checkpoint.load`` cannot make in time.

``dcp.load`` writes the saved optimizer states straight into the optimizer's arenas, and only
the optimizer's ``load_state_dict`` that follows compares formats. Saved states of another
format whose tensors have the same sizes (ECC-24 codes into ECC-32 arenas, Adam's first moment
into Lion's) are cast and written over the live states, and ``load_state_dict`` then refuses
them with the live states already overwritten. So are the states of another parameter of the
same size (parameters reordered since the save: an MLP's (4096, 1024) and (1024, 4096) weights
have q8 states of the same sizes), which ``load_state_dict`` refuses by their ``param_shape``.
An optimizer without state (no ``init_state()``) gives ``dcp.load`` nothing to fill: training
goes on from fresh moments, silently. So does a parameter frozen after training: the checkpoint
holds its state (the ECC master code too), but ``init_state()`` creates none for a frozen
parameter, and ``dcp.load`` drops what the target lacks. So are the momentum buffers of an SGD
saved with momentum, loaded into one built without: ``load_state_dict`` then takes the saved
momentum and restarts it from a zero buffer. The reverse (state keys, or a whole parameter's
state, that the checkpoint lacks: a parameter frozen when it was saved and trainable now) makes
``dcp.load`` fail with a bare "Missing key". :func:`check_dcp_load` finds these before
``dcp.load`` runs.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch

from memopt_core.errors import ConfigError, StateDictError
from memopt_core.optimizer import MemOptimizer
from memopt_core.sharding import local_shard
from memopt_core.state_dict_meta import META_KEY, saved_meta

__all__ = ["check_dcp_load"]

_UNREAD = -2.0  # a step count no checkpoint holds: the entry was not in it
#: the ``memopt`` entry's list of each group's normalizing beta2 (memopt-core's version 2)
_NORM_KEY = "decay_norm_beta2"
_PARAM_SHAPE = "param_shape"
#: the count a q8/fp8 second moment is stored for (memopt-core's record, since stop 67)
_NORM_STEP = "decay_norm_step"
#: the fields of the 'memopt' entry read from the checkpoint (None: not in it): core's, and
#: AdamBridge's family, precision and clipping state
_META_FIELDS = (
    "rule",
    "seed",
    "version",
    "compressed",
    "family",
    "precision",
    "clip_coef",
    "last_grad_norm",
)


def _read_meta(probe: dict[str, Any]) -> dict[str, Any] | None:
    """A probe's ``memopt`` fields (top level or groups, as ``load_state_dict`` reads them),
    without those the checkpoint lacks; None when it has none."""

    def found(entry: dict[str, Any]) -> dict[str, Any] | None:
        kept = {k: v for k, v in entry.items() if v is not None}
        return kept or None

    groups: list[dict[str, Any]] = [
        {"params": []} | ({META_KEY: m} if (m := found(g[META_KEY])) is not None else {})
        for g in probe["param_groups"]
        if g["params"] is not None  # a group the checkpoint holds
    ]
    return saved_meta({META_KEY: found(probe[META_KEY]), "param_groups": groups}, "the checkpoint")


def _flat_names(entry: Any, prefix: str = "") -> list[str]:
    """The keys DCP flattens a state entry into (nested dicts joined with dots)."""
    names: list[str] = []
    for k, v in entry.items():
        name = f"{prefix}{k}"
        names.extend(_flat_names(v, f"{name}.") if isinstance(v, dict) else [name])
    return names


def _saved_group_names(saved: list[dict[str, Any]]) -> list[list[str]] | None:
    """The parameter names each saved param group lists (torch's ``get_state_dict`` keys the
    state by name), or None for a dict keyed by parameter index (``opt.state_dict()``) or groups
    saved without their lists."""
    lists = [g["params"] for g in saved]
    if not any(lists) or not all(
        isinstance(ps, list) and all(isinstance(k, str) for k in ps) for ps in lists
    ):
        return None
    return lists


def _names_by_position(optimizer: Any, saved: list[list[str]]) -> list[str]:
    """The saved names taken in order for this optimizer's parameters (``get_state_dict``
    lists them in the optimizer's order): the check without a model."""
    for gi, (group, ps) in enumerate(zip(optimizer.param_groups, saved, strict=True)):
        if len(ps) != len(group["params"]):
            raise StateDictError(
                f"param group {gi} of the checkpoint lists {len(ps)} parameter(s), this "
                f"optimizer's has {len(group['params'])}"
            )
    return [k for ps in saved for k in ps]


def _live_named_state(
    model: torch.nn.Module, optimizer: Any, label_of: Any
) -> tuple[list[list[str]], dict[str, Any]]:
    """Each live param group's parameter names and the live state keyed by them, as torch's
    ``get_optimizer_state_dict`` names them (the names a ``get_state_dict`` checkpoint of this
    model holds: wrappers' prefixes removed, as its loader maps them)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    in_model = {id(p) for p in model.parameters()}  # (check_dcp_load checked its type)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in in_model:
                raise ConfigError(
                    f"{label_of(p)} of the optimizer is not a parameter of the "
                    "model given to check_dcp_load: pass the model the optimizer's state dict "
                    "is built from (get_state_dict(model, optimizer))"
                )
    # torch types every value as the union of all a state dict holds
    osd: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
    return [list(g["params"]) for g in osd["param_groups"]], osd["state"]


def _matched_groups(live: list[list[str]], saved: list[list[str]]) -> list[int | None]:
    """For each live param group, the saved group whose parameter names it shares
    (``set_state_dict`` takes a live group's hyperparameters from the saved group that lists
    its parameters, wherever it stands), or None where it shares none (parameters new here,
    or listed in no saved group: the state checks see any state they lack); for a group
    without parameters, the saved group without parameters."""
    saved_of = {name: si for si, ps in enumerate(saved) for name in ps}
    matched: list[int | None] = []
    for gi, ps in enumerate(live):
        found = sorted({saved_of[k] for k in ps if k in saved_of})
        if len(found) > 1:
            raise StateDictError(
                f"param group {gi} of this optimizer holds parameters of param groups {found} "
                "of the checkpoint: its parameters were grouped otherwise when it was saved, "
                "and set_state_dict would give them all the hyperparameters of one of those "
                "groups: build the groups as they were saved"
            )
        if not ps:
            found = [si for si, s in enumerate(saved) if not s][:1]
        matched.append(found[0] if found else None)
    return matched


def _adam_bridge(optimizer: Any) -> bool:
    """Whether ``optimizer`` is memopt-offload's AdamBridge (when that package is installed)."""
    try:
        from memopt_offload import AdamBridge
    except ImportError:
        return False
    return isinstance(optimizer, AdamBridge)


def check_dcp_load(
    optimizer: torch.optim.Optimizer,
    checkpoint_id: str | os.PathLike | None = None,
    *,
    key: str = "optim",
    model: torch.nn.Module | None = None,
    storage_reader: Any = None,
    process_group: Any = None,
) -> None:
    """Call before ``dcp.load`` (on every rank, as ``dcp.load``): raise when loading the
    optimizer state saved under ``key`` into ``optimizer`` would go wrong.

    ``ConfigError`` when a trainable parameter has no state yet (call
    ``optimizer.init_state()`` first), when the checkpoint holds state for a parameter index
    that has none here (a parameter frozen after training: create its state first), or none for
    one that has state here (frozen when saved, or without a gradient until then: the message
    says how to start it fresh);
    :class:`~memopt_core.errors.StateDictError` when a parameter's saved state keys differ from
    its live ones (an SGD saved with momentum and built without, or the reverse), when the
    checkpoint holds no memopt state under ``key``, or state of another rule, state-dict
    version, number of param groups, ``master`` / ``moments`` format, or
    ``compress_state_dict``, a seed ``load_state_dict`` would refuse, or state saved for a
    parameter of another shape at a parameter's index (its ``param_shape``; a checkpoint of a
    memopt that did not save it is not checked, and ``dcp.load`` of the optimizer's
    ``state_dict()``, which has it, reports it missing before loading anything).

    Rule, version, seed and ``compress_state_dict`` come from the saved dict's ``memopt``
    entry: its top-level one (``opt.state_dict()``), else the one in its param groups (torch's
    ``get_state_dict`` keeps only ``state`` and ``param_groups``, and memopt saves the entry in
    every group too; they must agree). A ``get_state_dict`` checkpoint keys the state by
    parameter name. Given ``model`` (the module given to ``get_state_dict``), the live
    parameters are named as torch's helpers name them and each live param group is matched
    to the saved group that lists the same names (``set_state_dict`` maps both by name, so an
    optimizer whose groups or parameters are listed in another order than when saved loads;
    its stochastic rounding then continues with other bits, as they are keyed by position).
    Without it the saved names are taken in order (``get_state_dict`` lists them in the
    optimizer's order), and such an optimizer is refused. A dict keyed by parameter index
    (``opt.state_dict()``) is matched by index, with or without ``model``. ``ConfigError``
    when an optimizer's parameter is not in ``model``, and, for a checkpoint keyed by name,
    when a frozen parameter has state (``set_state_dict`` hands it none: the load would drop
    it) or the checkpoint holds state for a parameter this optimizer lacks;
    :class:`~memopt_core.errors.StateDictError` when a live group holds parameters of several
    saved groups (grouped otherwise), or when the checkpoint's group without parameters is not
    its last (``set_state_dict`` maps it wrongly, a torch bug). Reads only
    those few values (``checkpoint_id``, ``storage_reader`` and ``process_group`` as in
    ``dcp.load``) and the names of the live state (``optimizer.state_dict()``, views;
    ``get_optimizer_state_dict(model, optimizer)`` with ``model``); changes
    nothing. A ``param_shape`` with another number of dimensions makes
    ``dcp.load`` raise its size mismatch here, also before anything is loaded. A saved step
    count that is not a whole number >= 0 (a corrupted checkpoint) is a ``StateDictError``
    too. Other values (moments, codes, a block scale byte of 255, which no format writes) are
    checked by ``load_state_dict`` only, after ``dcp.load`` wrote them into the live state.
    Last, a checkpoint of state-dict version 1 (its ``memopt`` entry without
    ``decay_norm_beta2``, which the optimizer's state dict has and ``dcp.load`` would report
    missing) is a ``StateDictError`` that says to drop that key from the state dict given to
    ``dcp.load``: everything else has been checked by then.

    ``optimizer`` may also be memopt-offload's ``AdamBridge``: its family, version, precision
    and clipping state are checked as its ``load_state_dict`` checks them (another precision's
    moments of the same shape would be cast in), its parameters have state from its
    construction on (no ``init_state()``), a parameter frozen when it was built has none (its
    saved state would be dropped: refused), and each saved host master is compared with its
    parameter's shape (AdamBridge saves no ``param_shape``). ``TypeError`` for other optimizers.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if model is not None and not isinstance(model, torch.nn.Module):
        # read only for a checkpoint keyed by name: one keyed by index passed it silently
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    bridge = _adam_bridge(optimizer)
    if not bridge and not isinstance(optimizer, MemOptimizer):
        raise TypeError(
            f"expected a memopt optimizer or memopt_offload.AdamBridge, got "
            f"{type(optimizer).__name__}"
        )

    def label_of(p: torch.Tensor) -> str:
        if bridge:  # AdamBridge names its parameters in its messages by shape
            return f"parameter of shape {tuple(p.shape)}"
        return cast(MemOptimizer, optimizer)._param_label(p)

    # AdamBridge holds host state for its trainable parameters from its construction
    stateless = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if not bridge and p.requires_grad and p not in optimizer.state
    ]
    if stateless:
        raise ConfigError(
            f"{label_of(stateless[0])} has no optimizer state yet: call "
            "optimizer.init_state() before building the state dict for dcp.load, which only "
            "fills tensors that exist (without them training would go on from fresh moments)"
        )
    n = len(optimizer.param_groups)
    # one group more than this optimizer has: a partial load leaves missing values None
    probe: dict[str, Any] = {
        META_KEY: dict.fromkeys(_META_FIELDS),
        "param_groups": [
            {"master": None, "moments": None, "params": None, META_KEY: dict.fromkeys(_META_FIELDS)}
            for _ in range(n + 1)
        ],
    }
    if storage_reader is None and isinstance(checkpoint_id, (str, os.PathLike)):
        # dcp.load raised torch's CheckpointException (a BaseException) with two tracebacks
        where = os.fspath(checkpoint_id)
        if not os.path.exists(where):
            raise FileNotFoundError(f"no checkpoint at {where!r}")
        if not os.path.isdir(where):
            raise StateDictError(
                f"{where!r} is a file; a torch.distributed.checkpoint checkpoint is a folder "
                "(a file written by memopt_checkpoint.save loads with memopt_checkpoint.load)"
            )
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    try:
        dcp.load(
            {key: probe},
            checkpoint_id=checkpoint_id,
            storage_reader=storage_reader,
            planner=planner,
            process_group=process_group,
        )
    except CheckpointException as e:  # a BaseException: it escaped `except Exception`
        # its text holds each rank's traceback, whose last line is the error
        cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise StateDictError(
            f"torch.distributed.checkpoint could not read a checkpoint at {checkpoint_id!r} "
            f"(a folder that holds none, an unfinished save, or a corrupt .metadata?): {cause}"
        ) from e
    # dcp.load set the planner up with the checkpoint's metadata
    metadata = planner.metadata
    assert metadata is not None
    meta = _read_meta(probe)
    if bridge:  # memopt-offload's AdamBridge: not a dependency, so not a type mypy knows
        cast(Any, optimizer)._checked_meta(meta, "the checkpoint")
    rule = meta.get("rule") if meta is not None else None
    if rule is None and not bridge:
        if meta is not None and meta.get("family") is not None:
            raise StateDictError(
                f"the checkpoint holds {meta['family']}'s state; this optimizer is a "
                f"{type(optimizer).__name__}"
            )
        raise StateDictError(
            f"the checkpoint holds no memopt optimizer state under {key!r} (no 'memopt' entry, "
            "at the top level or in the param groups: not saved by a memopt optimizer, saved "
            "through torch's get_state_dict by a memopt that kept the entry at the top level "
            "only, where get_state_dict drops it, or saved with "
            "StateDictOptions(flatten_optimizer_state_dict=True), which this check does not read)"
        )
    if not bridge and rule != cast(MemOptimizer, optimizer).rule:
        raise StateDictError(
            f"the checkpoint holds the state of a {rule!r} optimizer; this one runs "
            f"{cast(MemOptimizer, optimizer).rule!r}"
        )
    if not bridge:  # the version and seed load_state_dict checks, after dcp.load wrote
        cast(MemOptimizer, optimizer)._checked_meta(meta, "the checkpoint")
    saved = probe["param_groups"]
    count = sum(g["params"] is not None for g in saved)
    if count != n:
        found = f"more than {n}" if count > n else count
        raise StateDictError(f"the checkpoint has {found} param group(s), this optimizer has {n}")
    saved = saved[:n]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # the saved state's key of each parameter index: the index (opt.state_dict()), or the
    # parameter's name (torch's get_state_dict): read from the model when given (its groups
    # then matched by their names too), else taken by position in the saved groups
    saved_lists = _saved_group_names(saved)
    live_by_name: dict[str, Any] | None = None
    by_name: list[str] = []
    order: list[int | None] = list(range(n))  # the saved group of each live one
    if saved_lists is not None and model is not None:
        live_lists, live_by_name = _live_named_state(model, optimizer, label_of)
        order = _matched_groups(live_lists, saved_lists)
        by_name = [k for ps in live_lists for k in ps]
    elif saved_lists is not None:
        by_name = _names_by_position(optimizer, saved_lists)
    if saved_lists is not None:
        late_empty = [si for si, ps in enumerate(saved_lists[:-1]) if not ps]
        if late_empty and not all(group["params"] for group in optimizer.param_groups):
            raise StateDictError(
                f"param group {late_empty[0]} of the checkpoint has no parameters and is not "
                "its last: torch's set_state_dict hands this optimizer's group without "
                "parameters the last saved group's hyperparameters and 'memopt' entry instead "
                "(a torch bug), and the load would fail. To load it, move that group to the "
                f"end of sd[{key!r}]['param_groups'] after dcp.load, before set_state_dict"
            )
    for gi, (group, si) in enumerate(zip(optimizer.param_groups, order, strict=True)):
        if bridge:
            break  # one format for every group: its precision, checked above
        if si is None:
            continue  # no saved group holds its parameters (or their state)
        g = saved[si]
        # float32 parameters keep an fp32 master under any group master (as load_state_dict)
        master_unused = all(local_shard(p).dtype == torch.float32 for p in group["params"])
        for k in ("master", "moments"):
            if g[k] != group[k] and not (k == "master" and master_unused):
                mapped = "" if si == gi else f" (this optimizer's group {gi})"
                raise StateDictError(
                    f"param group {si} of the checkpoint{mapped} holds {k}={g[k]!r} states; "
                    f"this optimizer uses {k}={group[k]!r}: dcp.load would cast them into its live "
                    "states before load_state_dict refuses them: build the optimizer with the "
                    "format the checkpoint was saved with"
                )
    # a Flash optimizer's state dict says compressed= in every group's memopt entry; a
    # checkpoint of another memopt optimizer (MemOptimizer, ApexW) lacks the key, and dcp.load
    # fails on a key its target has and the checkpoint lacks
    if hasattr(optimizer, "compress_state_dict") and not bridge:
        stored = metadata.state_dict_metadata
        lacking = [
            gi for gi in range(n) if f"{key}.param_groups.{gi}.{META_KEY}.compressed" not in stored
        ]
        if lacking and any(k.startswith(f"{key}.param_groups.") for k in stored):
            raise StateDictError(
                f"the checkpoint's param group {lacking[0]} has no memopt['compressed'] (saved by "
                f"another memopt optimizer than {type(optimizer).__name__}), which this "
                "optimizer's state dict has: dcp.load fails on a key the checkpoint lacks. "
                "Drop it from the state dict you pass to dcp.load (sd['memopt'] and every "
                "sd['param_groups'][i]['memopt']: .pop('compressed')); load_state_dict then "
                "reads the state as compressed"
            )
    # None raised above: as no rule, or in AdamBridge's _checked_meta
    assert meta is not None
    # core's state dicts are compressed; FlashOptimizer(compress_state_dict=False) decodes
    compressed = meta.get("compressed") is not False
    if compressed != getattr(optimizer, "compress_state_dict", True):
        raise StateDictError(
            f"the checkpoint was saved with compress_state_dict={compressed}; set the "
            f"optimizer's compress_state_dict = {compressed} before building the state dict "
            "for dcp.load, so it has the saved layout"
        )
    saved_key: dict[int, Any] = dict(enumerate(by_name))
    # the state keys saved per parameter index (keys "<key>.state.<index or name>.<state
    # key>"): dcp.load drops saved keys the target lacks and fails on target keys the
    # checkpoint lacks
    prefix = f"{key}.state."
    position = {name: i for i, name in enumerate(by_name)}
    listed = position.keys() | {k for ps in saved_lists or [] for k in ps}
    saved_names: dict[int, set[str]] = {}
    for k in metadata.state_dict_metadata:
        if not k.startswith(prefix):
            continue
        rest = k[len(prefix) :]
        if by_name:
            # a name holds dots too: the first prefix before a dot that names a parameter
            cuts = (i for i, c in enumerate(rest) if c == ".")
            name = next((rest[:i] for i in cuts if rest[:i] in listed), None)
            if name is not None and name not in position:
                raise ConfigError(
                    f"the checkpoint holds optimizer state for {name!r}, which is not a "
                    "parameter of this optimizer: dcp.load would drop it. Add the parameter to "
                    "the optimizer (unfreeze it, call optimizer.init_state()) to keep its state"
                )
            if name is not None:
                saved_names.setdefault(position[name], set()).add(rest[len(name) + 1 :])
            continue
        digits, _, state_name = rest.partition(".")
        if digits.isdigit():
            saved_names.setdefault(int(digits), set()).add(state_name)
    if live_by_name is None:
        live = optimizer.state_dict()["state"]
    else:
        live = {position[k]: entry for k, entry in live_by_name.items()}
    for index in sorted(saved_names):
        if index >= len(params):
            raise StateDictError(
                f"the checkpoint holds optimizer state for parameter index {index}; this "
                f"optimizer has {len(params)} parameters"
            )
        if index not in live:
            as_name = f", saved as {saved_key[index]!r}" if index in saved_key else ""
            fix = (
                "(frozen when the AdamBridge was built, so it made none): dcp.load would drop "
                "it. Build the AdamBridge with the parameter trainable, then freeze it"
                if bridge
                else "(frozen, so init_state() made none?): dcp.load would drop it. Create its "
                "state first: unfreeze it, call optimizer.init_state(), freeze it again"
                + (" once set_state_dict has run" if by_name else "")
            )
            raise ConfigError(
                f"the checkpoint holds optimizer state for parameter index {index} "
                f"({label_of(params[index])}{as_name}), which has none here {fix}"
            )
    for index, entry in live.items():
        label = f"parameter index {index} ({label_of(params[index])})"
        if index in saved_key:
            label = f"{label}, saved as {saved_key[index]!r}"
        names = set(_flat_names(entry))
        saved = saved_names.get(index)
        if saved is None:
            strict = (
                ", and pass options=StateDictOptions(strict=False) to set_state_dict, which "
                "refuses a trainable parameter's missing state otherwise"
                if by_name
                else ""
            )
            raise ConfigError(
                f"the checkpoint holds no optimizer state for {label} (frozen when it was "
                "saved, or without a gradient until then: memopt optimizers, as torch's, create "
                "a parameter's state at its first step with one, and init_state() creates it "
                "before): dcp.load would fail "
                "on its missing keys. To start it from fresh "
                f"state, delete its entry from the state dict given to dcp.load (del "
                f"sd[{key!r}]['state'][{saved_key.get(index, index)!r}]){strict}: "
                "load_state_dict then leaves it without state, and its next step with a "
                "gradient starts it fresh"
            )
        if by_name and not params[index].requires_grad:
            raise ConfigError(
                f"{label} is frozen (requires_grad=False) but has optimizer state: torch's "
                "set_state_dict hands no state to a parameter that does not require grad, so "
                "the load would drop its state. Keep it trainable until set_state_dict has "
                "run, then freeze it again"
            )
        dropped = sorted(saved - names)
        if dropped:
            raise StateDictError(
                f"the checkpoint holds {dropped} for {label}, which this optimizer's state "
                "lacks (built with other hyperparameters, e.g. SGD's momentum=0?): dcp.load "
                "would drop them silently and training would go on without them. Build the "
                "optimizer with the hyperparameters the checkpoint was saved with, then call "
                "init_state()"
            )
        missing = sorted(names - saved)
        if _NORM_STEP in missing and set(missing) <= {_NORM_STEP, _PARAM_SHAPE}:
            # a partial load would leave the live record, a view of the optimizer's own
            # counters, beside the saved counts: the moments would then be converted from it
            raise StateDictError(
                f"the checkpoint holds no {_NORM_STEP!r} for {label}: an older memopt saved it, "
                "or its state was written into optimizer.state by hand and not stepped before "
                "the save (its q8/fp8 second moments are stored for their saved 'step'). Delete "
                "that key "
                "from every state entry of the dict given to dcp.load (for entry in "
                f"sd[{key!r}]['state'].values(): entry.pop({_NORM_STEP!r}, None)); "
                "load_state_dict then reads the moments as stored for their step"
            )
        if missing and missing != [_PARAM_SHAPE]:  # param_shape: an older memopt, see below
            raise StateDictError(
                f"the checkpoint holds no {missing} for {label} (saved with other "
                "hyperparameters, e.g. SGD's momentum=0?): dcp.load would fail on the missing "
                "keys. Build the optimizer with the hyperparameters the checkpoint was saved "
                "with, or delete those keys from the state dict given to dcp.load"
            )
    # the saved shape and step count of each parameter index (state_dict() numbers every
    # parameter in order; get_state_dict names them): a second read, so a size mismatch in it cannot hide the format checks
    # above. dcp.load writes the counts into the live ones too, before load_state_dict refuses a
    # negative or fractional one
    shapes = {index: tuple(params[index].shape) for index in live}
    if bridge:  # AdamBridge saves no param_shape: its host master has the parameter's shape
        for i, shape in shapes.items():
            saved_master = metadata.state_dict_metadata.get(f"{prefix}{saved_key.get(i, i)}.master")
            size = getattr(saved_master, "size", None)
            if size is not None and tuple(size) != shape:
                raise StateDictError(
                    f"the checkpoint's master weight of parameter index {i} has shape "
                    f"{tuple(size)}; this optimizer's parameter {i} has shape {shape}: the "
                    "state belongs to another parameter (were the parameters reordered, or the "
                    "model changed, since it was saved?)"
                )
    state = {
        saved_key.get(i, i): {
            "param_shape": torch.full((len(s),), -1, dtype=torch.int64, device="cpu"),
            "step": torch.full((), _UNREAD, dtype=torch.float32, device="cpu"),
        }
        for i, s in shapes.items()
    }
    dcp.load(
        {key: {"state": state}},
        checkpoint_id=checkpoint_id,
        storage_reader=storage_reader,
        planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
        process_group=process_group,
    )
    for i, shape in shapes.items():
        entry = state[saved_key.get(i, i)]
        if entry["step"].item() != _UNREAD:
            MemOptimizer._validated_step(entry["step"], f"parameter index {i} in the checkpoint")
        saved = tuple(entry["param_shape"].tolist())
        if saved == (-1,) * len(shape):
            continue  # saved without param_shape (an older memopt)
        if saved != shape:
            raise StateDictError(
                f"the checkpoint's state of parameter index {i} was saved for a parameter of "
                f"shape {saved}; this optimizer's parameter {i} has shape {shape}: the state "
                "belongs to another parameter (were the parameters reordered, or the model "
                "changed, since it was saved?), and dcp.load would write it over the live states "
                "before load_state_dict refuses it"
            )
    # memopt-core's state dicts of version 2 record each group's normalizing beta2 beside the
    # rule (Adam's 8-bit second moments are stored divided by their decay); a checkpoint of
    # version 1 lacks the key, and dcp.load fails on a key its target has and it lacks. Last,
    # so that everything else has been checked when the key is dropped as the message says
    # (AdamBridge's too, with update="host", whose entry carries its host optimizer's list)
    if _NORM_KEY in optimizer.state_dict()[META_KEY]:
        saved_keys = metadata.state_dict_metadata
        places = [f"{key}.{META_KEY}"] + [f"{key}.param_groups.{gi}.{META_KEY}" for gi in range(n)]
        if any(
            f"{w}.version" in saved_keys and f"{w}.{_NORM_KEY}" not in saved_keys for w in places
        ):
            raise StateDictError(
                f"the checkpoint's memopt entry has no {_NORM_KEY!r} (saved by a memopt of "
                "state-dict version 1, whose 8-bit second moments are Adam's v itself), which "
                "this optimizer's state dict has: dcp.load fails on a key the checkpoint lacks. "
                "Drop it from the state dict you pass to dcp.load (sd['memopt'] and every "
                f"sd['param_groups'][i]['memopt']: .pop({_NORM_KEY!r})); load_state_dict then "
                "reads the second moments as v, and the next step normalizes them"
            )
