"""Hugging Face export: a checkpoint's weights as the folder ``from_pretrained`` loads.

The folder holds safetensors shards named as transformers names them
(``model-00001-of-00003.safetensors``), ``model.safetensors.index.json`` (``weight_map``
and ``metadata.total_size``) and, if given, ``config.json``. Every safetensors file
carries the metadata ``{"format": "pt"}``: transformers 4.x refuses files without it.

Tied weights (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``, one tensor in
the model) are stored once, as ``save_pretrained`` does, and transformers ties them again
on load. Which names are tied is the architecture's knowledge, not the checkpoint's:
it is read from the model the config describes, built on the meta device (no memory, no
download), when transformers is installed; a pair is dropped only if its stored bytes
are identical too. Without a config every tensor is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.access import Access
from unbroken.errors import CheckpointError
from unbroken.format.directory import Directory
from unbroken.format.layout import Manifest, nbytes_of
from unbroken.format.offline import cast, export_names, read_all

log = logging.getLogger("unbroken")

INDEX = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what transformers 4.x checks before loading a file
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Exported:
    files: list[str]
    tensors: int
    nbytes: int
    tied: dict[str, str]  # name left out -> the name it is tied to


def parse_size(text: str) -> int:
    """``"5GB"`` (decimal, as transformers reads it), ``"2GiB"``, ``"500MB"`` or bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B|)\s*", text.upper())
    if match is None or float(match[1]) <= 0:
        raise CheckpointError(f"--max-shard-size {text!r}: give a size such as 5GB or 500MiB")
    return int(float(match[1]) * _UNITS[match[2]])


def export(
    directory: Directory,
    manifest: Manifest,
    out: str,
    *,
    only: list[str],
    dtype: torch.dtype | None = None,
    strip: Sequence[str] = (),
    max_shard_size: int = 5 * 10**9,
    config: str | None = None,
    progress: Callable[[int], None] = lambda n: None,
    threads: int = 4,
) -> Exported:
    """Write the tensors of the state entries ``only`` (named as `export_names` says)
    as a Hugging Face folder ``out`` (which must not exist). The folder appears whole or
    not at all: it is written beside ``out`` and renamed. One shard is in memory at once.
    The folder and its files get `Access.from_env` modes (0700 / 0600), whatever the umask."""
    access = Access.from_env()
    names = export_names(manifest, only, strip)
    tied = _tied(manifest, names, config)
    keys = [key for key, name in names.items() if name not in tied]
    sizes = {key: _exported_bytes(manifest, key, dtype) for key in keys}
    shards = _shards(keys, sizes, max_shard_size)
    partial = f"{out}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    access.makedirs(partial)
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, tensor in read_all(directory, manifest, shard, threads).items():
            tensors[names[key]] = cast(tensor, dtype)
            progress(sum(c.nbytes for c in manifest.tensors[key].chunks))
            weight_map[names[key]] = file
        save_file(tensors, os.path.join(partial, file), METADATA, access)
        files.append(file)
    total = sum(sizes.values())
    index = {
        "metadata": {"total_size": total, "unbroken_step": manifest.step},
        "weight_map": dict(sorted(weight_map.items())),
    }
    access.write_text(os.path.join(partial, INDEX), json.dumps(index, indent=2))
    if config is not None:
        with open(config, "rb") as src:
            fd = access.open(os.path.join(partial, "config.json"), os.O_WRONLY | os.O_TRUNC)
            with os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
    if os.path.isdir(out):  # the caller allowed replacing it
        shutil.rmtree(out)
    os.replace(partial, out)
    return Exported([*files, INDEX], len(keys), total, tied)


def check_destination(out: str) -> None:
    """Refuse, before anything is read, a file ``out`` whose folder is missing or not
    writable: one line and exit code 2, not an error from the writer after the reading."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"cannot write {out}: the folder {folder} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: the folder {folder} is not writable")


def save_file(
    tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str], access: Access
) -> None:
    """safetensors' ``save_file`` with ``access``'s file mode whatever the umask. The file
    is made first with that mode: safetensors versions that write into it keep the mode,
    those that rename a 0600 temporary file over it get it set after."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file as save

    os.close(access.open(path, os.O_WRONLY | os.O_TRUNC))
    try:
        save(tensors, path, metadata=metadata)
    except SafetensorError as e:  # the disk is full, say: the path and why, in one line
        raise CheckpointError(f"cannot write {path}: {e}") from None
    os.chmod(path, access.file_mode)


def _exported_bytes(manifest: Manifest, key: str, dtype: torch.dtype | None) -> int:
    entry = manifest.tensors[key]
    stored = entry.torch_dtype
    target = dtype if dtype is not None and stored.is_floating_point else stored
    return nbytes_of(target, entry.shape)


def _shards(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``keys`` in order, cut into shards of at most ``limit`` bytes (a larger tensor is
    a shard of its own, as in transformers)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key in keys:
        if shards[-1] and used + sizes[key] > limit:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards


def _tied(manifest: Manifest, names: dict[str, str], config: str | None) -> dict[str, str]:
    """Exported names to leave out, each mapped to the name it is tied to: those the
    architecture ties whose stored bytes are identical."""
    if config is None:
        return {}
    key_of = {name: key for key, name in names.items()}
    tied: dict[str, str] = {}
    for group in tie_groups(config):
        present = [name for name in group if name in key_of]
        for name in present[1:]:
            if _same_bytes(manifest, key_of[present[0]], key_of[name]):
                tied[name] = present[0]
    return tied


def _same_bytes(manifest: Manifest, a: str, b: str) -> bool:
    ea, eb = manifest.tensors[a], manifest.tensors[b]
    return (ea.dtype, ea.shape) == (eb.dtype, eb.shape) and [c.xxh3 for c in ea.chunks] == [
        c.xxh3 for c in eb.chunks
    ]


def tie_groups(config: str) -> list[list[str]]:
    """Parameter names that are one tensor in the model ``config`` describes (in the
    model's order: the first is the one kept), or [] without transformers."""
    try:
        import transformers
    except ImportError:
        return []
    with open(config) as f:
        fields = json.load(f)
    if "model_type" not in fields:
        raise CheckpointError(f"{config} has no model_type; is it a transformers config.json?")
    try:
        cfg = transformers.AutoConfig.for_model(**fields)
        with torch.device("meta"):
            model = _model(transformers, cfg)
    except Exception as e:  # an architecture this transformers does not know
        log.warning("%s: cannot build the model to find tied weights (%s); keeping all", config, e)
        return []
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _model(transformers: Any, cfg: Any) -> torch.nn.Module:
    """The model class the config names, else the causal LM or base model of its type."""
    for arch in getattr(cfg, "architectures", None) or []:
        if (cls := getattr(transformers, arch, None)) is not None:
            return cls(cfg)
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg)
    except ValueError:
        return transformers.AutoModel.from_config(cfg)
