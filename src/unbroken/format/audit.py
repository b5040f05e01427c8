"""Re-reading every stored byte of a step and checking it, as `unbroken verify` does:
checksums, file sizes and safetensors headers, reported rather than raised."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unbroken.errors import CorruptCheckpointError
from unbroken.format.blockio import read_into, verify_chunk
from unbroken.format.directory import Directory
from unbroken.format.layout import Manifest, step_dir
from unbroken.format.validate import MAX_HEADER, header_ranges


@dataclass(frozen=True)
class Damage:
    file: str
    tensor: str | None
    problem: str


def verify(
    directory: Directory, manifest: Manifest, progress: Callable[[int], None] = lambda n: None
) -> list[Damage]:
    """Re-read every stored byte of ``manifest``'s step and check it; ``progress`` gets the
    number of bytes checked after each block. Returns what is damaged (empty if nothing)."""
    folder = step_dir(manifest.step)
    damage: list[Damage] = []
    # One buffer for every block, as large as the largest: bytes, not tensors, so that
    # `unbroken verify` never imports torch.
    buffer = bytearray(
        max((c.nbytes for e in manifest.tensors.values() for c in e.chunks), default=0)
    )
    broken_files: set[str] = set()
    for file, expected in sorted(manifest.files.items()):
        try:
            size = directory.storage.size(f"{folder}/{file}")
        except FileNotFoundError:
            damage.append(Damage(file, None, "the file is missing"))
            broken_files.add(file)
            continue
        except CorruptCheckpointError as e:  # a link: named, never followed
            damage.append(Damage(file, None, str(e)))
            broken_files.add(file)
            continue
        if size != expected:
            damage.append(Damage(file, None, f"{size} bytes on storage, {expected} written"))
            broken_files.add(file)
        else:
            _check_header(directory, folder, file, size, manifest, damage)
    for key, entry in manifest.tensors.items():
        for chunk in entry.chunks:
            if chunk.file in broken_files:
                progress(chunk.nbytes)
                continue
            view = memoryview(buffer)[: chunk.nbytes]
            try:
                read_into(directory.storage, folder, key, chunk.file, chunk.start, view)
                verify_chunk(folder, key, chunk, view)
            except CorruptCheckpointError:
                damage.append(Damage(chunk.file, key, "checksum mismatch"))
            progress(chunk.nbytes)
    return damage


def _check_header(
    directory: Directory, folder: str, file: str, size: int, manifest: Manifest,
    damage: list[Damage],
) -> None:  # fmt: skip
    """A shard's safetensors header must parse and list every block the manifest puts in
    the file: restore never reads it, but other tools do, so verify reports its damage."""
    length = bytearray(8)
    try:
        directory.storage.read_into(f"{folder}/{file}", 0, memoryview(length))
        n = min(int.from_bytes(length, "little"), MAX_HEADER, max(0, size - 8))
        header = bytearray(8 + n)
        directory.storage.read_into(f"{folder}/{file}", 0, memoryview(header))
        listed = header_ranges(bytes(header), size, f"{folder}/{file}")
    except (CorruptCheckpointError, OSError, EOFError) as e:
        damage.append(Damage(file, None, str(e)))
        return
    for key, entry in manifest.tensors.items():
        for chunk in entry.chunks:
            listed_here = (chunk.start, chunk.end) in listed or chunk.end == chunk.start
            if chunk.file == file and not listed_here:
                damage.append(Damage(file, key, "the safetensors header does not list it"))
