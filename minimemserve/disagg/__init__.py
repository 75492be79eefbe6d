"""Instances with roles, the recipes that compose pool calls, and the transports between them.

Data plane: :mod:`minimemserve.disagg.transport`; control plane:
:mod:`minimemserve.disagg.control` (imports ZeroMQ and msgpack, so it is not imported here).
"""

from minimemserve.disagg.transport import (
    CopyTransport,
    GlooTransport,
    SharedHandle,
    SharedMemoryTransport,
    SharedPoolTensor,
    SharedTensorFactory,
    TransferMode,
    Transport,
    TransportKind,
    attach,
    choose_transport,
)

__all__ = [
    "CopyTransport",
    "GlooTransport",
    "SharedHandle",
    "SharedMemoryTransport",
    "SharedPoolTensor",
    "SharedTensorFactory",
    "TransferMode",
    "Transport",
    "TransportKind",
    "attach",
    "choose_transport",
]
