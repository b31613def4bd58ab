"""What a plan read from the model, read again at every pass: a reused stream never yields a stale merge.

A :class:`~lora_stream.ParamStream` is planned once, from the model's structure (which modules, which parameter
objects, their whole shapes and dtypes) and from its adapter state (each tuner layer's active adapters, whether
adapters are disabled, whether peft merged them in place, each adapter's scaling; each ``modules_to_save`` wrapper's
choice). All of that can change after construction -- ``model.set_adapter("b")``, ``merge_adapter()``, ``with
model.disable_adapter():``, ``set_scale``, a parameter replaced -- and a pass that went on with the old plan would
merge the wrong adapter, add a delta twice, or read a parameter the model no longer uses, without any error.

The planner therefore records, as it reads them, every such fact together with how to read it again
(:class:`PlanWitness`). Each pass, and each sink's pre-flight, reads them all again and compares
(:meth:`PlanWitness.check`): a change raises :class:`~lora_stream.errors.StalePlanError` naming it, before anything is
gathered or sent. Reading them is attribute access and identity comparison only: no tensor data is read and
nothing is communicated, so every rank checks on its own and the ranks' status exchange makes them agree. The facts
that must be the same on every rank (adapter state, structure names; not object identities) are also part of the
plan's digest, so ranks whose models were set to different adapters fail the first exchange instead of serving a
mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import StalePlanError

__all__ = ["PlanWitness", "tuner_state", "wrapper_state"]

#: Per-adapter settings of a tuner layer that a merge depends on (peft keeps each in a dict keyed by adapter).
_ADAPTER_SETTINGS = ("scaling", "r", "lora_alpha", "use_dora", "lora_bias", "alpha", "rank_dropout_scale")

#: bitsandbytes' quantized parameter classes (see :mod:`lora_stream.base_weights`).
_QUANTIZED_PARAMS = ("Params4bit", "Int8Params")

#: A changed plan's error lists at most this many changes (the first ones, in the model's order).
_MAX_LISTED = 6


@dataclass(frozen=True)
class _Fact:
    #: What was read, for the error (``"module 'layers.0.q_proj': adapter state"``).
    what: str
    read: Callable[[], Any]
    expected: Any
    #: Compares the value read now with ``expected``.
    same: Callable[[Any, Any], bool]
    #: What of ``expected`` every rank shares (names, shapes, adapter state; not object identities), for the
    #: plan's digest.
    shared: str


def _equal(a: Any, b: Any) -> bool:
    return bool(a == b)


def _same_objects(a: tuple[tuple[str, Any], ...], b: tuple[tuple[str, Any], ...]) -> bool:
    """Names equal and objects identical (never ``==`` on tensors or modules)."""
    return len(a) == len(b) and all(na == nb and oa is ob for (na, oa), (nb, ob) in zip(a, b))


def _same_params(a: tuple[tuple[Any, ...], ...], b: tuple[tuple[Any, ...], ...]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] and x[2:] == y[2:] for x, y in zip(a, b, strict=True))


def _layout(p: Any, shape: Callable[[Any], Any], dtype: Callable[[Any], Any]) -> tuple[Any, Any]:
    """A parameter's whole shape and dtype as the merge reads them. A bitsandbytes weight's storage may change
    shape in place (its CPU repacking at the first eval forward), which the merge follows; its logical shape may not."""
    if type(p).__name__ in _QUANTIZED_PARAMS:
        state = getattr(p, "quant_state", None)
        return (tuple(state.shape) if state is not None else None), "quantized"
    return tuple(shape(p)), dtype(p)


def _names(rows: tuple[tuple[str, Any], ...]) -> tuple[str, ...]:
    return tuple(name for name, _ in rows)


def _without_objects(rows: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
    return tuple((row[0], *row[2:]) for row in rows)


def tuner_state(layer: Any) -> tuple[tuple[str, Any], ...]:
    """What a merge of peft tuner ``layer`` depends on besides tensor data: ``disable_adapters``, the active
    adapters, the adapters merged in place, and each active adapter's settings (scaling, rank, DoRA, ...)."""
    disabled = bool(getattr(layer, "disable_adapters", False))
    active = tuple(getattr(layer, "active_adapters", ()) or ())
    state: list[tuple[str, Any]] = [
        ("disable_adapters", disabled),
        ("active_adapters", active),
        ("merged_adapters", tuple(getattr(layer, "merged_adapters", ()) or ())),
    ]
    for a in active:
        for attr in _ADAPTER_SETTINGS:
            values = getattr(layer, attr, None)
            if isinstance(values, dict) and a in values:
                v = values[a]
                if isinstance(v, (bool, int, float, str)) or v is None:
                    state.append((f"{attr}[{a!r}]", v))
    return tuple(state)


def wrapper_state(wrapper: Any) -> tuple[tuple[str, Any], ...]:
    """What a peft ``modules_to_save`` wrapper's choice of copy depends on."""
    saved = getattr(wrapper, "modules_to_save", None)
    return (
        ("disable_adapters", bool(getattr(wrapper, "disable_adapters", False))),
        ("active_adapters", tuple(getattr(wrapper, "active_adapters", ()) or ())),
        ("saved_for", tuple(saved.keys()) if saved is not None and hasattr(saved, "keys") else ()),
    )


def _describe_state(before: tuple[tuple[str, Any], ...], now: tuple[tuple[str, Any], ...]) -> str:
    old, new = dict(before), dict(now)
    switched = [k for k in ("disable_adapters", "active_adapters", "merged_adapters") if old.get(k) != new.get(k)]
    if switched:  # another adapter set: its settings differ by nature, and say nothing more
        return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in switched)
    parts = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    return ", ".join(parts) or "changed"


class PlanWitness:
    """The facts one plan was built from, each with how to read it again.

    The planner calls :meth:`module`, :meth:`params`, :meth:`param`, :meth:`tuner` and :meth:`wrapper` as it reads
    the model; a stream calls :meth:`check` at the start of every pass (and sinks in their pre-flight, through
    :meth:`ParamStream.check_plan <lora_stream.ParamStream.check_plan>`). A fact that cannot be read any more (a
    module lost an attribute) counts as changed.
    """

    def __init__(self) -> None:
        self._facts: list[_Fact] = []

    def __len__(self) -> int:
        return len(self._facts)

    def _add(
        self,
        what: str,
        read: Callable[[], Any],
        same: Callable[[Any, Any], bool] = _equal,
        shared: Callable[[Any], Any] = lambda value: value,
    ) -> None:
        value = read()
        self._facts.append(_Fact(what, read, value, same, repr(shared(value))))

    # -- what the planner records ----------------------------------------------------------------------------------
    def module(self, module: Any, src: str) -> None:
        """``module``'s children (names and objects): a module wrapped by a new adapter, or replaced, changes it."""
        children = module._modules

        def read() -> tuple[tuple[str, Any], ...]:
            return tuple((k, v) for k, v in children.items() if v is not None)

        self._add(f"module {src or '<root>'!r}: its child modules", read, _same_objects, _names)

    def params(
        self, module: Any, src: str, read_params: Callable[[], list[tuple[str, Any]]], shape: Any, dtype: Any
    ) -> None:
        """``module``'s own parameters as the gatherer lists them: names, objects, whole shapes and dtypes."""

        def read() -> tuple[tuple[Any, ...], ...]:
            return tuple((n, p, *_layout(p, shape, dtype)) for n, p in read_params())

        self._add(f"module {src or '<root>'!r}: its parameters", read, _same_params, _without_objects)

    def param(self, module: Any, name: str, src: str, get: Callable[[], Any], shape: Any, dtype: Any) -> None:
        """One parameter the planner reached by name (a LoRA factor): its object, whole shape and dtype."""

        def read() -> tuple[tuple[Any, ...], ...]:
            p = get()
            return ((name, p, *_layout(p, shape, dtype)),)

        self._add(f"module {src!r}: its parameter {type(module).__name__}.{name}", read, _same_params, _without_objects)

    def tuner(self, layer: Any, src: str) -> None:
        """A peft tuner layer's adapter state (:func:`tuner_state`), and the modules holding each adapter's
        factors (``lora_A``, ``lora_B``, DoRA's magnitude, ...): an adapter deleted and added again under the same
        name has new factor modules, which the plan's references would not follow."""
        self._add(f"module {src!r}: adapter state", lambda: tuner_state(layer))
        for attr in getattr(layer, "adapter_layer_names", ()):
            container = getattr(layer, attr, None)
            if container is not None and hasattr(container, "_modules") and container._modules:
                self.module(container, f"{src}.{attr}" if src else attr)

    def wrapper(self, wrapper: Any, src: str) -> None:
        """A peft ``modules_to_save`` wrapper's state (:func:`wrapper_state`) and its copies."""
        self._add(f"module {src!r}: modules_to_save state", lambda: wrapper_state(wrapper))
        saved = getattr(wrapper, "modules_to_save", None)
        if saved is not None and hasattr(saved, "_modules"):
            self.module(saved, f"{src}.modules_to_save" if src else "modules_to_save")

    # -- what a pass checks ----------------------------------------------------------------------------------------
    def digest(self) -> str:
        """The facts every rank must share, as text (part of the plan digest the ranks compare at each exchange)."""
        return ";".join(f"{f.what}={f.shared}" for f in self._facts)

    def changes(self, limit: int | None = _MAX_LISTED) -> list[str]:
        """What differs now from what the plan read, in the model's order: one entry per kind of change, naming
        the first module it was found in and how many share it (at most ``limit`` entries)."""
        found: dict[str, list[str]] = {}
        for f in self._facts:
            subject, _, _ = f.what.partition(": ")
            try:
                now = f.read()
            except Exception as exc:  # a fact that can no longer be read has changed
                detail = f"{f.what.partition(': ')[2]} can no longer be read ({type(exc).__name__}: {exc})"
            else:
                if f.same(f.expected, now):
                    continue
                detail = self._describe(f, now)
            if detail not in found and limit is not None and len(found) >= limit:
                continue
            found.setdefault(detail, []).append(subject)
        out = []
        for detail, subjects in found.items():
            more = f" (and {len(subjects) - 1} more like it)" if len(subjects) > 1 else ""
            out.append(f"{subjects[0]}{more}: {detail}")
        return out

    def check(self, where: str = "") -> None:
        """Raise :class:`~lora_stream.errors.StalePlanError` if anything the plan read from the model changed since."""
        changes = self.changes()
        if changes:
            raise StalePlanError(
                f"{where}the model changed since this stream was planned: {'; '.join(changes)}. A pass would yield "
                "the old plan's merge, so nothing was gathered or sent: build a new ParamStream (or AdapterStream) "
                "after changing the model's adapters (use_lora_stream's hook does it by itself)",
                changes=changes,
            )

    @staticmethod
    def _describe(f: _Fact, now: Any) -> str:
        """The change, without the module's name (changes shared by many modules are reported once)."""
        what = f.what.partition(": ")[2]
        if what.endswith("state"):
            return f"{what}: {_describe_state(f.expected, now)}"
        if what.endswith("child modules"):
            old, new = dict(f.expected), dict(now)
            names = [k for k in dict.fromkeys([*old, *new]) if old.get(k) is not new.get(k)]
            return f"{what}: {', '.join(repr(n) for n in names)} added, removed or replaced"
        changed = []
        old_rows = {row[0]: row for row in f.expected}
        for row in now:
            before = old_rows.pop(row[0], None)
            if before is None:
                changed.append(f"{row[0]!r} added")
            elif before[1] is not row[1]:
                changed.append(f"{row[0]!r} replaced by another parameter object")
            elif before[2:] != row[2:]:
                changed.append(f"{row[0]!r} {before[2]} {before[3]} -> {row[2]} {row[3]}")
        changed += [f"{n!r} removed" for n in old_rows]
        return f"{what or 'parameter'}: {', '.join(changed) or 'changed'}"
