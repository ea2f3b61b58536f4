"""Errors raised by the runtime; each message names the rank/field involved."""


class AFDError(RuntimeError):
    """Base class of runtime failures."""


class ConnectorClosedError(AFDError):
    """The connector was closed while an operation was pending or requested."""


class PeerLostError(AFDError):
    """A peer rank died or stopped answering within the configured timeout."""


class PairingError(AFDError):
    """A reply does not match the dispatch it should answer (layer/sequence/stage/rows)."""


class PayloadError(AFDError):
    """A received header or payload violates the wire format."""


class DeviceUnavailableError(AFDError):
    """The requested device type cannot be used in this process."""
