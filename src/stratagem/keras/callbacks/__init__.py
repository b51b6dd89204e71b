"""``sg.keras.callbacks``: Keras's callback hooks and its callbacks, one module each as Keras
lays them out (``keras/src/callbacks/``).

Every worker runs every callback's hooks (so a callback may take part in a collective, as
``EarlyStopping`` reading the global ``val_loss`` does); what a callback *prints* or *writes*
happens on the chief only, and never makes the others wait.

Of the callbacks that write files (``CSVLogger``, ``ModelCheckpoint``, ``BackupAndRestore``,
``TensorBoard``), only the chief writes; every worker runs the hooks and none waits for the
writes (checkpoints go through ``sg.train.Checkpoint``, whose ``write`` is chief-only and
atomic), except once at the end of ``fit``, so that what follows it on any worker sees the last
checkpoint. On several machines the directories must be on a filesystem every worker sees,
since all of them read a backup on restore.
"""

from stratagem.keras.callbacks.backup_and_restore import BackupAndRestore
from stratagem.keras.callbacks.callback import Callback
from stratagem.keras.callbacks.callback import Logs as Logs
from stratagem.keras.callbacks.callback import format_logs as format_logs
from stratagem.keras.callbacks.callback import is_chief as is_chief
from stratagem.keras.callbacks.callback_list import CallbackList
from stratagem.keras.callbacks.csv_logger import CSVLogger
from stratagem.keras.callbacks.early_stopping import EarlyStopping
from stratagem.keras.callbacks.history import History
from stratagem.keras.callbacks.learning_rate_scheduler import LearningRateScheduler
from stratagem.keras.callbacks.model_checkpoint import ModelCheckpoint
from stratagem.keras.callbacks.monitor import MonitorCallback
from stratagem.keras.callbacks.progbar_logger import ProgbarLogger
from stratagem.keras.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from stratagem.keras.callbacks.sidecar_evaluator_model_export import SidecarEvaluatorModelExport
from stratagem.keras.callbacks.tensorboard import TensorBoard
from stratagem.keras.callbacks.terminate_on_nan import TerminateOnNaN

# Keras's public names. The helpers the callbacks share (Logs, format_logs, is_chief)
# stay importable from here, as Model's evaluate uses them, without being part of the API.
__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "MonitorCallback",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "SidecarEvaluatorModelExport",
    "TensorBoard",
    "TerminateOnNaN",
]
