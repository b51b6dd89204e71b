"""``sg.launch``: run a function as a local cluster of worker processes, from a notebook or any
interpreter (``notebook_launcher``, as Accelerate's)."""

from stratagem.launch.notebook import UnsupportedLaunchOption, WorkerFailedError, notebook_launcher

__all__ = ["UnsupportedLaunchOption", "WorkerFailedError", "notebook_launcher"]
