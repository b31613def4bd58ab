"""Hooks for testing the transaction guarantees (see the Guarantees page); never install one in production.

:func:`set_fault_hook` installs a callable that every sink calls, on every rank, at each named point of its
transaction (:data:`FAULT_POINTS`); raising from it fails the sync there, as a real failure at that point would.
:func:`fault_point` calls the installed hook, for a test that adds a point of its own. The implementation lives in
:mod:`lora_stream.transaction`; this module is where tests import it from::

    from lora_stream.testing import set_fault_hook

    set_fault_hook(lambda point: ...)  # raise at the point to fail there
    try:
        ...  # sink.sync(...)
    finally:
        set_fault_hook(None)
"""

from __future__ import annotations

from .transaction import FAULT_POINTS, FaultHook, fault_point, set_fault_hook

__all__ = ["FAULT_POINTS", "FaultHook", "fault_point", "set_fault_hook"]
