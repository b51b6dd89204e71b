"""``CallbackList``: the callbacks of one fit, evaluate or predict, called hook by hook."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from stratagem.keras.callbacks.callback import Callback

if TYPE_CHECKING:
    from stratagem.keras.model import Model


class CallbackList:
    """Calls one hook on every callback in order."""

    def __init__(self, callbacks: Iterable[Callback], model: Model, params: dict[str, Any]):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks must be sg.keras.callbacks.Callback objects, got "
                    f"{type(cb).__name__}"
                )
            cb.set_model(model)
            cb.set_params(params)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call
