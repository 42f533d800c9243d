"""Wrapping a module's ``forward`` so that several callbacks can wrap the same module, each removed on its own in any
order. Each wrapper calls ``wrapper.inner``; removing one relinks the chain around it."""

from __future__ import annotations

from typing import Callable

from torch import nn


def wrap_forward(module: nn.Module, make: Callable[[Callable], Callable], innermost: bool = False) -> Callable:
    """Install ``make(call_inner)`` as ``module.forward``. ``innermost``: right above the module's own forward,
    under any wrappers already there (recomputation must see the hooks of the others from outside)."""
    def call_inner(*args, **kwargs):
        return wrapper.inner(*args, **kwargs)

    wrapper = make(call_inner)
    outer, f = None, module.forward
    while innermost and hasattr(f, "inner"):
        outer, f = f, f.inner
    wrapper.inner = f
    if outer is None:
        module.forward = wrapper
    else:
        outer.inner = wrapper
    return wrapper


def unwrap_forward(module: nn.Module, wrapper: Callable) -> None:
    """Remove ``wrapper`` wherever it is in the chain (a no-op when it is gone already)."""
    f = module.forward
    if f is wrapper:
        inner = wrapper.inner
        if getattr(inner, "__self__", None) is module and getattr(inner, "__func__", None) is type(module).forward:
            del module.forward  # back to the class's own method
        else:
            module.forward = inner
        return
    while hasattr(f, "inner"):
        if f.inner is wrapper:
            f.inner = wrapper.inner
            return
        f = f.inner
