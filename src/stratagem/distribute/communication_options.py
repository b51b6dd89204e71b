"""How MultiWorkerMirroredStrategy and FullyShardedStrategy communicate (TF's
``tf.distribute.experimental.CommunicationOptions``, ``CommunicationImplementation``); the
public names are in ``sg.distribute.experimental``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from stratagem.comm.compression import check_compression


class CommunicationImplementation(enum.Enum):
    """Which collective implementation MultiWorkerMirroredStrategy uses (TF's names).

    RING: gloo's ring algorithms, on CPU or CUDA tensors. NCCL: NCCL for CUDA tensors (on a
    CPU-only worker it falls back to RING with a warning). AUTO: NCCL when the worker computes
    on CUDA, else RING.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """``sg.distribute.experimental.CommunicationOptions`` (TF's signature).

    ``bytes_per_pack``: gradient bucket size, each all-reduced while backward goes on; 0 (TF's
    "determined automatically") is one pack at the end of backward (TF's own choice for 0) where
    all workers share one host whose cores they fill, else 4 MiB buckets after a first of 1 MiB
    (``comm.bucketing``); ``timeout_seconds``: how
    long one collective may take before it fails naming the peer (None = STRATAGEM_OP_TIMEOUT or
    60 s). ``compression`` (ours; TF has none): None, or ``"bf16"``/``"fp16"`` to send float32
    gradient buckets in 16 bits (half the bytes) while every addition stays float32; fp16
    chunks travel scaled by a power of two, so nothing overflows (``comm.compression``). The
    same name and ``"bf16"`` value as ``ParameterServerStrategy(compression=)``.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be an int >= 0, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 or None, got {self.timeout_seconds!r}")
        check_compression(self.compression, what="CommunicationOptions")
        if not isinstance(self.implementation, CommunicationImplementation):
            raise ValueError(
                "implementation must be a CommunicationImplementation (AUTO, RING, NCCL), got "
                f"{self.implementation!r}"
            )
