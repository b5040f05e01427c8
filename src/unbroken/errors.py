"""Errors raised by unbroken. Every message names what is wrong and what to do."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved or restored as asked (bad path, step, keys, shapes...)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match the manifest: truncated file, bad checksum, bad header."""


class PeerLostError(CheckpointError):
    """A peer of the group this work runs on is gone (its connections closed, or the
    generation aborted because it failed): in-process recovery takes it as a peer's
    failure, not as an error of the training code."""


class StorageError(CheckpointError, OSError):
    """Storage refused what a save asked of it (full, not permitted, read-only...): the
    message names the checkpoint, the step and the rank, and says what to do. An
    `OSError` too, with the system's ``errno``, for callers that catch those."""
