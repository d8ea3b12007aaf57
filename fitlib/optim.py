"""``HPOptimizer``: one interface to the hyper-parameters of any optimizer.

Schedulers, the LR finder and mixed precision set ``lr``, ``mom``, ``wd`` and
``beta`` through this wrapper and never need to know which torch optimizer is
underneath. The mapping is read from the optimizer's parameter groups:

==========  ==========================  ============================
name        Adam, AdamW, NAdam, RAdam   SGD, RMSprop, others
==========  ==========================  ============================
lr          ``lr``                      ``lr``
mom         ``betas[0]``                ``momentum``
beta        ``betas[1]``                ``alpha`` (RMSprop)
wd          ``weight_decay``            ``weight_decay``
==========  ==========================  ============================

With ``true_wd=True`` weight decay is decoupled from the gradient (AdamW
style, ``p -= lr * wd * p`` before the step) for every optimizer: natively
where the optimizer has a ``decoupled_weight_decay`` flag, by the wrapper
otherwise.

Schedules and reductions compose: a scheduler writes through
``set_scheduled``, which multiplies its value by the factors that ``scale``
has accumulated in this fit (``ReduceLROnPlateau``'s reductions), as torch's
chained schedulers multiply. ``set`` and the properties write exactly the
value given. ``fit`` forgets the factors when it starts and ends; in between
they live in the parameter groups, so a checkpoint keeps them.

Any other hyper-parameter in the parameter groups is reached by its torch
name through the same ``get``, ``set``, ``set_scheduled`` and ``scale``:
``"eps"``, ``"dampening"``, a custom optimizer's own key, or one element of a
tuple, ``"betas[1]"``. A torch name that one of fitlib's names maps onto is
that name (``ALIASES``): ``"weight_decay"`` is ``wd`` (decoupled too, with
``true_wd``), ``"betas[0]"`` and ``"momentum"`` are ``mom``, ``"betas[1]"``
and ``"alpha"`` are ``beta``; so they share one scale factor and one schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import fitlib.hyper_tensors as hyper_tensors
from fitlib.grad_scaling import found_inf
from fitlib.hyper_checks import (
    ALIASES,
    LR,
    check_hyper,
    check_lr,
    check_no_parts,
    check_opt_func,
    check_params,
    count_mismatch,
    group_key,
    groups_hold,
    hyper_key,
    is_hyper_number,
    lr_per_group,
)
from fitlib.hyper_checks import NAMES as _NAMES
from fitlib.hyper_checks import TRUE_WD_KEY as _TRUE_WD_KEY

HyperParam = float | Sequence[float]
NAMES = _NAMES  # fitlib's names of hyper-parameters (hyper_checks.NAMES)


def _hyper(name: str) -> property:
    """The property ``name`` of ``HyperParams``: reads ``get(name)``, as one
    value when every group shares it; sets ``set(name, value)``."""

    def read(self: HyperParams) -> float | list[float]:
        values = self.get(name)  # one value where every group has the same
        return values[0] if all(v == values[0] for v in values) else values

    def write(self: HyperParams, value: HyperParam) -> None:
        self.set(name, value)

    return property(read, write, doc=f"``{name}``: one value, or one per group.")


class HyperParams:
    """``lr``, ``mom``, ``wd``, ``beta`` as properties over ``get`` and ``set``:
    one value when every group shares it, else one per group. What
    ``HPOptimizer`` and ``MultiOptimizer`` share."""

    def get(self, name: str) -> list[float]:
        raise NotImplementedError

    def set(self, name: str, value: Any) -> None:
        raise NotImplementedError

    lr = _hyper("lr")
    mom = _hyper("mom")
    beta = _hyper("beta")
    wd = _hyper("wd")


class HPOptimizer(HyperParams):
    """Wraps a torch optimizer and exposes ``lr``, ``mom``, ``wd``, ``beta``.

    Each hyper-parameter reads as a float when all parameter groups share it,
    else as a list with one value per group; it can be set to a float (all
    groups) or to a sequence with one value per group (discriminative rates).

    Args:
        params: parameters or parameter-group dicts, as for any torch optimizer.
        opt_func: the optimizer class, e.g. ``torch.optim.SGD``.
        lr: learning rate: a number, one per parameter group, or a slice
            spread over the groups (see ``lr_per_group``).
        mom: momentum (SGD, RMSprop) or beta1 (Adam family); None keeps the
            optimizer's default.
        wd: weight decay.
        beta: Adam's beta2 or RMSprop's alpha; None keeps the default.
        true_wd: decouple weight decay from the gradient (AdamW style).

    Examples:
        >>> opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        >>> opt.lr = 0.01; opt.mom = 0.9; opt.wd = 1e-4
        >>> opt.lr, opt.mom, opt.wd, opt.opt.param_groups[0]["momentum"]
        (0.01, 0.9, 0.0001, 0.9)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        opt_func: Callable[..., torch.optim.Optimizer],
        lr: LR,
        mom: HyperParam | None = None,
        wd: HyperParam = 0.0,
        beta: HyperParam | None = None,
        true_wd: bool = False,
    ) -> None:
        check_lr(lr)
        check_no_parts(lr, "lr")
        check_opt_func(opt_func)
        params = check_params(params)
        # As torch reads params: a list of group dicts, or one group.
        lrs = lr_per_group(lr, len(params) if isinstance(params[0], dict) else 1)
        self._adopt(opt_func(params, lr=lrs[0]), true_wd)
        self._write_values("lr", lrs)
        if mom is not None:
            self.mom = mom
        if beta is not None:
            self.beta = beta
        self.wd = wd

    @classmethod
    def wrap(cls, opt: torch.optim.Optimizer) -> HPOptimizer:
        """An ``HPOptimizer`` over an existing optimizer, its settings as they
        are (an int ``lr`` or ``momentum``, e.g. SGD's default 0, becomes the
        same float).

        Examples:
            >>> opt = HPOptimizer.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
            >>> opt.lr
            0.1
        """
        if isinstance(opt, HPOptimizer):
            return opt
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"opt must be a torch.optim.Optimizer or an HPOptimizer; got "
                f"{type(opt).__name__}. Fix: fitlib.HPOptimizer(model.parameters(), "
                "torch.optim.SGD, lr=0.1)."
            )
        wrapper = cls.__new__(cls)
        wrapper._adopt(opt, true_wd=False)
        return wrapper

    def _adopt(self, opt: torch.optim.Optimizer, true_wd: bool) -> None:
        self.opt, self.true_wd = opt, true_wd
        self.stepped: tuple[Any, Any] | None = None
        # Set by MixedPrecision(float16): step() then goes through the scaler.
        self.grad_scaler: torch.amp.GradScaler | None = None
        self._live, self._mirror = [], []  # hypers_as_tensors: tensors, floats
        # Adam, AdamW, NAdam, RAdam can decouple weight decay themselves.
        self._native_wd = "decoupled_weight_decay" in opt.param_groups[0]
        # An int lr or momentum (SGD's default momentum=0) becomes the same
        # float, so the (lr, mom) that each step notes are floats as they are.
        for group in opt.param_groups:
            for key in ("lr", "momentum"):
                if type(group.get(key)) is int:
                    group[key] = float(group[key])

    # -- the wrapped optimizer -------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    @property
    def state(self) -> dict:
        return self.opt.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Applies decoupled weight decay (if the wrapper owns it), then steps.

        Notes in ``stepped`` the ``(lr, mom)`` of the last parameter group that
        this step uses: a scheduler may set the next values before anyone reads
        them (the Recorder reads ``stepped`` at the end of the batch).

        With a ``grad_scaler`` (set by ``MixedPrecision(torch.float16)``) the
        step goes through ``grad_scaler.step``, which skips it when the
        gradients are not finite.
        """
        self.stepped = lr_and_momentum(self.opt.param_groups[-1], self._mirror[-1:])
        if self.grad_scaler is not None:
            return self._scaled_step(closure)
        if self.true_wd and not self._native_wd:
            self._decay()
        return self.opt.step(closure)

    def _scaled_step(self, closure: Callable[[], Any] | None) -> Any:
        if closure is not None:
            raise ValueError(
                "HPOptimizer.step: a closure cannot be used with a GradScaler "
                "(MixedPrecision(torch.float16)). Fix: step without a closure, "
                "or train in bfloat16 (no scaler)."
            )
        scaler = self.grad_scaler
        if self.true_wd and not self._native_wd:
            if not scaler._per_optimizer_states[id(self.opt)]["found_inf_per_device"]:
                scaler.unscale_(self.opt)  # unless MixedPrecision already did
            # The scaler skips a step with non-finite gradients: so does the
            # decay, masked on the device (no sync).
            self._decay(keep=1 - found_inf(scaler, self.opt))
        return scaler.step(self.opt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def lr_and_momentum(self) -> tuple[Any, Any]:
        """The last group's lr and momentum as a step uses them now (floats,
        read from the mirror where they are tensors: no device read)."""
        return lr_and_momentum(self.opt.param_groups[-1], self._mirror[-1:])

    def hypers_as_tensors(self, names: Any = None) -> tuple[str, ...]:
        """Holds ``lr``, and Adam's ``betas`` (``mom``, ``beta``), as 0-d
        tensors on the parameters' device (float64 on the CPU, where a step
        equals the float one; float32 elsewhere), written in place from then
        on, so that a compiled optimizer step sees one graph while a schedule
        changes them (which optimizers take which, and why those dtypes:
        ``fitlib.hyper_tensors``). Returns the names held as tensors; ``names``
        picks some; a ValueError names the optimizer, the hyper-parameter and
        the fix where one cannot be a tensor. Idempotent. Getters, ``stepped``
        and ``state_dict`` still give floats (a mirror: no device read).

        Examples:
            >>> adamw = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
            >>> adamw.hypers_as_tensors()
            ('lr', 'mom', 'beta')
            >>> adamw.lr = 2e-3; adamw.lr, adamw.param_groups[0]["lr"]
            (0.002, tensor(0.0020, dtype=torch.float64))
        """
        return hyper_tensors.as_tensors(self, names)

    def hypers_as_floats(self, names: Any = None) -> tuple[str, ...]:
        """Undoes ``hypers_as_tensors`` for ``names``, or all: the mirror's floats
        back in the groups (no device read); returns the names still tensors.

        Examples:
            >>> adamw = HPOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
            >>> adamw.hypers_as_tensors(), adamw.hypers_as_floats(("lr",))
            (('lr', 'mom', 'beta'), ('mom', 'beta'))
            >>> adamw.param_groups[0]["lr"]
            0.001
        """
        return hyper_tensors.as_floats(self, names)

    def state_dict(self) -> dict:
        """The optimizer's state, hyper-parameters included, and ``true_wd``."""
        state = hyper_tensors.floats_in(self.opt.state_dict(), self._mirror)
        return {"opt": state, "true_wd": self.true_wd}  # floats in files

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"opt", "true_wd"}:
            raise ValueError(
                "HPOptimizer.load_state_dict: expected the dict that "
                f"HPOptimizer.state_dict() returns (keys 'opt', 'true_wd'), got "
                f"keys {sorted(state)}. Fix: for a bare torch optimizer's state "
                "use opt.opt.load_state_dict(state)."
            )
        self.opt.load_state_dict(state["opt"])
        hyper_tensors.reinstall(self.param_groups, self._live, self._mirror)
        self.true_wd = state["true_wd"]

    def __repr__(self) -> str:
        hps = {k: getattr(self, k) for k in ("lr", "mom", "wd", "beta") if self.has(k)}
        inner = type(self.opt).__name__
        return f"HPOptimizer({inner}, true_wd={self.true_wd}, {hps})"

    # -- hyper-parameters ------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether the wrapped optimizer has hyper-parameter ``name``: one of
        ``lr``, ``mom``, ``wd``, ``beta``, or a number that every parameter
        group holds under that key (``"eps"``, ``"betas[1]"``)."""
        return self._key(self.canonical(name), raise_missing=False) is not None

    def get(self, name: str) -> list[float]:
        """The value of hyper-parameter ``name`` for every group: ``lr``,
        ``mom``, ``wd``, ``beta``, or any number in the groups, by its torch
        name (``"eps"``, ``"betas[1]"``, a custom optimizer's own key).

        Examples:
            >>> adam = HPOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
            >>> adam.set("eps", 1e-6)
            >>> adam.get("eps"), adam.get("betas[1]"), adam.beta
            ([1e-06], [0.999], 0.999)
        """
        name = self.canonical(name)
        key, index = self._key(name)
        if self._mirror and (key, index) in self._mirror[0]:
            return [floats[key, index] for floats in self._mirror]
        return [_read(g, key, index) for g in self.param_groups]

    def set(self, name: str, value: HyperParam) -> None:
        """Sets hyper-parameter ``name`` (float, or one value per group), any
        that ``get`` reads.

        The one write path: the properties and schedulers all come here.
        """
        name = self.canonical(name)
        self._write_values(name, self._per_group(name, value))

    def canonical(self, name: str) -> str:
        """``name`` as this optimizer's wrapper knows it: a torch key that one
        of fitlib's names maps onto here is that name (``"weight_decay"`` is
        ``"wd"``, Adam's ``"betas[0]"`` is ``"mom"``), so both share the
        decoupled decay and the scale factor; any other name is itself."""
        alias = ALIASES.get(name)
        if alias is None:
            return name
        key, index = hyper_key(name)
        if alias == "wd" and key in self.param_groups[0]:
            return alias  # (with true_wd, wd is not the group's weight_decay)
        return alias if self._key(alias, False) == (key, index) else name

    def hyper_names(self) -> list[str]:
        """What ``get``, ``set`` and a schedule can name on this optimizer:
        fitlib's names it has, then the numbers its parameter groups hold,
        by their torch names (``"betas[0]"`` for a tuple's element).

        Examples:
            >>> HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).hyper_names()
            ['lr', 'mom', 'wd', 'momentum', 'dampening', 'weight_decay']
        """
        names = [n for n in NAMES if self.has(n)]
        for key, value in self.param_groups[0].items():
            if key == "params" or key.startswith("fitlib_"):
                continue
            if isinstance(value, (tuple, list)):
                names += [f"{key}[{i}]" for i in range(len(value))]
            elif key != "lr":
                names.append(key)
        return [
            n
            for n in names
            if n in NAMES or groups_hold(self.param_groups, *hyper_key(n))
        ]

    def _write_values(self, name: str, values: list[float]) -> None:
        """Writes checked values, one per group."""
        if name == "wd" and self.true_wd:
            self._set_true_wd(values)
            return
        if name == "wd" and not any(values) and not self.has("wd"):
            return  # no weight decay on an optimizer without one: nothing to do
        key = self._key(name)  # (group key, tuple index)
        if self._live and key in self._live[0]:
            return hyper_tensors.write_live(self._live, self._mirror, key, values)
        for group, v in zip(self.param_groups, values):
            hyper_tensors.put(group, *key, v)

    def set_lr(self, lr: LR, name: str = "lr") -> None:
        """Sets the learning rate to train at, as the constructor does: a
        number > 0, one per group, or a slice spread over the groups (checked
        by ``check_lr``, spread by ``lr_per_group``; ``name`` is the argument
        the messages name).

        Examples:
            >>> body, head = nn.Linear(8, 16), nn.Linear(16, 3)
            >>> groups = [{"params": body.parameters()}, {"params": head.parameters()}]
            >>> opt = HPOptimizer(groups, torch.optim.SGD, lr=0.1)
            >>> opt.set_lr(slice(1e-4, 1e-2))  # 2 groups: 1e-4, 1e-2
            >>> opt.lr
            [0.0001, 0.01]
        """
        self._write_values("lr", self.spread_lr(lr, name))

    def spread_lr(self, lr: LR, name: str = "lr") -> list[float]:
        """``lr`` checked (``check_lr``) and spread over this optimizer's
        groups (``lr_per_group``): one value per group.

        Examples:
            >>> layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
            >>> groups = [{"params": layer.parameters()} for layer in layers]
            >>> opt = HPOptimizer(groups, torch.optim.SGD, lr=0.1)
            >>> opt.spread_lr(slice(1e-4, 1e-2))  # 3 groups
            [0.0001, 0.001, 0.01]
        """
        check_lr(lr, name)
        check_no_parts(lr, name)
        return lr_per_group(lr, len(self.param_groups), name)

    def set_scheduled(self, name: str, value: HyperParam) -> None:
        """Sets ``name`` to a schedule's ``value`` times the factors ``scale``
        accumulated in this fit: a reduction persists under a schedule."""
        name = self.canonical(name)
        values = self._per_group(name, value)
        factors = [g.get(_scale_key(name), 1.0) for g in self.param_groups]
        self._write_values(name, [v * f for v, f in zip(values, factors)])

    def scale(self, name: str, factors: HyperParam) -> None:
        """Multiplies ``name`` by ``factors`` now, and every value a scheduler
        sets later in this fit (through ``set_scheduled``).

        Any hyper-parameter ``get`` reads can be scaled; ``ReduceLROnPlateau``
        scales ``lr`` only.

        Examples:
            >>> opt.scale("lr", 0.5)  # halves lr, and the rest of the schedule
            >>> opt.lr
            0.05
        """
        name = self.canonical(name)
        factors = self._per_group(f"{name} factor", factors)
        values = self.get(name)
        for group, f in zip(self.param_groups, factors):
            group[_scale_key(name)] = group.get(_scale_key(name), 1.0) * f
        self.set(name, [v * f for v, f in zip(values, factors)])

    def reset_scales(self) -> None:
        """Forgets the factors of ``scale`` (``fit`` does, as it starts and ends)."""
        for group in self.param_groups:
            for key in [k for k in group if k.endswith("_scale")]:
                if key.startswith("fitlib_"):  # (_scale_key's)
                    del group[key]

    # -- internals -------------------------------------------------------------
    def _set_true_wd(self, values: list[float]) -> None:
        for group, v in zip(self.param_groups, values):
            group[_TRUE_WD_KEY] = v
            if self._native_wd:
                group["decoupled_weight_decay"] = True
            if "weight_decay" in group:
                group["weight_decay"] = v if self._native_wd else 0.0

    def _key(self, name: str, raise_missing: bool = True) -> tuple | None:
        """The (group key, tuple index) of ``name`` (``group_key``)."""
        return group_key(self, name, raise_missing)

    def _per_group(self, name: str, value: HyperParam) -> list[float]:
        """``value`` (one number, or one per group) as one checked float per group."""
        n = len(self.param_groups)
        if is_hyper_number(value):
            values = [value] * n
        elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
            values = list(value)  # a list, tuple, numpy array...
        else:
            values = [value]  # refused below, by type
        check_hyper(name, values, value)
        if len(values) != n:
            raise ValueError(count_mismatch(name, values, n))
        return [float(v) for v in values]

    def _decay(self, keep: Any = 1) -> None:
        """``p *= 1 - lr * wd``; ``keep`` (a 0/1 device tensor) may cancel it."""
        decays = []  # (runs at every step: kept lean)
        for group in self.opt.param_groups:
            wd = group.get(_TRUE_WD_KEY, 0.0)
            if wd:  # wd alone decides (a captured step keeps its decay at lr 0)
                decays.append((group["lr"] * wd, group["params"]))  # (no read)
        if not decays:  # wd=0: no grad-mode switch at every step
            return
        with torch.no_grad():
            for decay, params in decays:
                factor = 1.0 - decay * keep
                for p in params:
                    if p.grad is not None:
                        p.mul_(factor)


def lr_and_momentum(group: dict, mirror: list[dict] = ()) -> tuple[Any, Any]:
    """A parameter group's lr and momentum (Adam's beta1; None if it has none);
    ``mirror``: [the floats of its tensors] (``hypers_as_tensors``), read instead."""
    betas = group.get("betas")
    lr, mom = group["lr"], group.get("momentum") if betas is None else betas[0]
    if mirror:
        lr, mom = mirror[0].get(("lr", None), lr), mirror[0].get(("betas", 0), mom)
    return lr, float(mom) if type(mom) is int else mom  # SGD's momentum=0


def _read(group: dict, key: str, index: int | None) -> float:
    value = group.get(key, 0.0)
    return float(value if index is None else value[index])


def _scale_key(name: str) -> str:
    return f"fitlib_{name}_scale"  # in the group, so a checkpoint keeps it
