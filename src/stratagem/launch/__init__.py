"""``sg.launch``: run a function as a local cluster of worker processes, from a notebook or any
interpreter (``notebook_launcher``, as Accelerate's)."""

from stratagem.launch.notebook import WorkerFailedError, notebook_launcher

__all__ = ["WorkerFailedError", "notebook_launcher"]
