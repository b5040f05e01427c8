"""Errors raised by unbroken. Every message names what is wrong and what to do."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved or restored as asked (bad path, step, keys, shapes...)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match the manifest: truncated file, bad checksum, bad header."""
