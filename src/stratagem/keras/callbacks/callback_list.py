"""``CallbackList``: the callbacks of one fit, evaluate or predict, called hook by hook."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stratagem.keras.callbacks.callback import Callback, FitModel, Logs


class CallbackList:
    """Calls one hook on every callback in order. As Keras 3's, the logs every callback of one
    call sees are one dict, sorted by name, of plain floats (so that a callback adding an
    entry, as ``LearningRateScheduler`` adds ``learning_rate``, shows it to the later ones,
    ``History`` last)."""

    def __init__(self, callbacks: Iterable[Callback], model: FitModel, params: dict[str, Any]):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks must be sg.keras.callbacks.Callback objects, got "
                    f"{type(cb).__name__}"
                )
            cb.set_model(model)
            cb.set_params(params)

    def note(self, line: str) -> bool:
        """Hand a line about the job (an elastic job's change of workers) to the callbacks
        that show such lines (``ProgbarLogger``, under its bar); whether one printed it."""
        shown = [cb.note(line) for cb in self.callbacks if callable(getattr(cb, "note", None))]
        return any(shown)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any, logs: Logs | None = None) -> None:
            if args and isinstance(args[-1], dict | type(None)):
                *args, logs = args  # type: ignore[assignment]
            plain = _pythonify(logs)
            for cb in self.callbacks:
                getattr(cb, hook)(*args, plain)

        return call


def _pythonify(logs: Logs | None) -> Logs:
    """Keras's ``pythonify_logs``: sorted by name, values as floats where they convert."""
    result: dict[str, Any] = {}
    for key, value in sorted((logs or {}).items()):
        try:
            result[key] = float(value)
        except (TypeError, ValueError):
            result[key] = value
    return result
