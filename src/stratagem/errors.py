"""Errors stratagem raises on purpose.

Every error says what was received and what was expected; the classes let callers (and the
launcher's exit reasons) tell a bad configuration from a lost peer.
"""

from __future__ import annotations


class StratagemError(Exception):
    """Base class of the errors stratagem raises on purpose."""


class ClusterConfigError(StratagemError, ValueError):
    """A cluster description (TF_CONFIG, torchrun or SLURM variables, a ClusterSpec) is invalid."""


class DeviceError(StratagemError, ValueError):
    """A device string names no device this process has."""


class InputError(StratagemError, ValueError):
    """Input data cannot be distributed as asked (a batch that does not split, say)."""


class ModelOutputError(StratagemError, ValueError):
    """A model's output cannot give what Keras-style training asks of it: a loss (no ``.loss``
    and no compiled loss), or a prediction for the compiled loss and metrics (no ``.logits``,
    no output named at compile)."""


class UnavailableOptimizerError(StratagemError, ValueError):
    """A Keras optimizer name that this torch has no implementation of (``"lion"``)."""


class RendezvousError(StratagemError, RuntimeError):
    """The processes of a job could not meet: a peer never came, a port is taken, sizes differ."""


class PeerLostError(StratagemError, RuntimeError):
    """A peer process died or became unreachable during a collective operation."""


class MembershipChanged(PeerLostError):
    """In an elastic job: a collective ended because a peer was lost, or the agent abandoned it
    for a new round; the elastic layer catches it and rebuilds the group (``rebuild``)."""


class StaleGroupError(RendezvousError):
    """A group made before an elastic rebuild (a mesh's dimension) used after it: such groups
    are not rebuilt in place."""


class PeerDataError(StratagemError, ValueError):
    """A peer sent data outside the fixed schema of an exchange (nothing a peer sends is
    unpickled: object exchanges carry plain data and tensors only)."""


class CollectiveTimeoutError(StratagemError, TimeoutError):
    """A collective operation did not complete within its timeout although every peer is alive."""


class ReplicaError(StratagemError, RuntimeError):
    """Replicas of one step disagreed (one stopped at a sync point the others never reached)."""


class CheckpointError(StratagemError, ValueError):
    """A checkpoint cannot be written, read, or matched to the objects it should restore."""


class CheckpointMatchError(CheckpointError, AssertionError):
    """A ``LoadStatus`` assertion failed (an AssertionError too, as in TensorFlow)."""


class SharedParameterError(StratagemError, ValueError):
    """A parameter shared by layers on several pipeline stages (tied embeddings) cannot be kept
    one parameter by the schedule asked for."""
