"""torch.distributed.checkpoint through unbroken.dcp: DCP's own save/load and planners,
unbroken's storage, format and checksums; and `unbroken convert` between the formats."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unbroken.dcp
from ranks import run_ranks
from unbroken.cli.main import main as cli
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.directory import Directory
from unbroken.storage import open_storage

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an Adam that has taken one step (so it has state), from ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.randn(5, 8)).pow(2).mean().backward()
    optim.step()
    return model, optim


def dcp_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def assert_same(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple) -> None:
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def load_into_fresh(reader: StorageReader) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optim = build(seed=7)  # different values everywhere, lr included
    state = dcp_state(model, optim)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optim


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_save_load_round_trip_and_unbroken_reads_it(where, tmp_path, request):
    if where == "s3":
        path, options = request.getfixturevalue("bucket")
    else:
        path, options = str(tmp_path / "ckpt"), None
    saved = build(seed=0)
    dcp.save(
        dcp_state(*saved), storage_writer=unbroken.dcp.Writer(path, step=3, storage_options=options)
    )
    loaded = load_into_fresh(unbroken.dcp.Reader(path, storage_options=options))
    assert_same(saved, loaded)

    directory = Directory(open_storage(path, options), path)
    assert directory.latest() == 3
    manifest = directory.manifest(3)
    assert manifest.tensors["model/0.weight"].shape == [32, 8]  # unbroken's key naming
    raw = json.loads(directory.storage.read("step-000000003/manifest.json"))
    assert raw["dcp"]["metadata"]["state_dict"]["model.0.weight"]["type"] == "tensor"
    assert raw["dcp"]["metadata"]["state_dict"]["optim.param_groups.0.lr"] == {"type": "bytes"}
    if where == "local":
        assert cli(["verify", path]) == 0
        assert cli(["export", path, str(tmp_path / "weights.safetensors")]) == 0
        weights = load_file(tmp_path / "weights.safetensors")
        assert weights.keys() == saved[0].state_dict().keys()


@pytest.mark.timeout(30)
def test_a_committed_step_is_never_replaced(tmp_path):
    path = str(tmp_path / "ckpt")
    state = dcp_state(*build(seed=0))
    dcp.save(state, storage_writer=unbroken.dcp.Writer(path, step=1))
    with pytest.raises(CheckpointException, match="step 1 is already committed") as failure:
        dcp.save(state, storage_writer=unbroken.dcp.Writer(path, step=1))
    assert isinstance(failure.value.failures[0][0], CheckpointError)
    dcp.save(state, storage_writer=unbroken.dcp.Writer(path, step=2))
    dcp.save(state, storage_writer=unbroken.dcp.Writer(path, step=0))  # an older step
    assert Directory(open_storage(path), path).steps() == [0, 1, 2]
    assert unbroken.dcp.latest(path) == 2  # `latest` never moves back


@pytest.mark.timeout(30)
def test_a_corrupted_byte_is_detected_and_named(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(dcp_state(*build(seed=0)), storage_writer=unbroken.dcp.Writer(path, step=1))
    chunk = Directory(open_storage(path), path).manifest(1).tensors["model/2.weight"].chunks[0]
    shard = tmp_path / "ckpt" / "step-000000001" / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.start + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as failure:
        load_into_fresh(unbroken.dcp.Reader(path))
    error = failure.value.failures[0][0]  # DCP wraps each rank's error
    assert isinstance(error, CorruptCheckpointError)
    assert "tensor 'model/2.weight'" in str(error) and chunk.file in str(error)


@pytest.mark.timeout(30)
def test_reader_explains_a_checkpoint_not_written_through_dcp(tmp_path):
    path = str(tmp_path / "ckpt")
    model, _ = build(seed=0)
    with unbroken.Checkpointer(path) as ckpt:
        ckpt.save(1, {"model": model})
    with pytest.raises(CheckpointException, match=r"was not written through unbroken\.dcp"):
        load_into_fresh(unbroken.dcp.Reader(path))


@pytest.mark.timeout(30)
def test_reader_on_a_native_dcp_folder_points_to_its_reader_and_convert(tmp_path):
    path = str(tmp_path / "native")
    dcp.save(dcp_state(*build(seed=0)), storage_writer=FileSystemWriter(path))
    with pytest.raises(CheckpointException) as failure:
        load_into_fresh(unbroken.dcp.Reader(path))
    error = str(failure.value.failures[0][0])
    assert "FileSystemReader" in error and f"unbroken convert {path} DST --to unbroken" in error


def _fsdp(rank: int, world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`build`'s model, FSDP2-sharded over ``world`` ranks, after one step of Adam."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3 * (seed + 1))
    torch.manual_seed(seed * 10 + rank)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    optim.step()
    return model, optim


def _fsdp_job(rank: int, world: int, path: str, options: dict | None, out: str) -> None:
    """On ``world`` ranks: save an FSDP2 model and its optimizer as step 1; then load step
    0 (saved whole by one process) into a fresh FSDP2 model, each rank reading only part
    of each stored block. Rank 0 torch.saves both, whole, into ``out``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    whole = StateDictOptions(full_state_dict=True)
    model, optim = _fsdp(rank, world, seed=0)
    writer = unbroken.dcp.Writer(path, step=1, storage_options=options)
    dcp.save(dcp_state(model, optim), storage_writer=writer)
    saved = get_state_dict(model, optim, options=whole)

    model, optim = _fsdp(rank, world, seed=5)
    state = dcp_state(model, optim)
    dcp.load(state, storage_reader=unbroken.dcp.Reader(path, step=0, storage_options=options))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = get_state_dict(model, optim, options=whole)
    if rank == 0:  # tensors in a result would need the rank alive to be read
        torch.save({"saved": saved, "loaded": loaded}, out)


def assert_same_state(model_sd: dict, optim_sd: dict, model: nn.Module, optim) -> None:
    for name, value in model_sd.items():
        assert torch.equal(model.state_dict()[name], value), name
    theirs: dict = get_state_dict(model, optim)[1]
    assert optim_sd["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]
    for fqn, state in optim_sd["state"].items():
        for k, v in state.items():
            assert torch.equal(theirs["state"][fqn][k], v), (fqn, k)


@pytest.mark.timeout(90)
def test_fsdp2_on_two_ranks_reshards_both_ways_through_s3(bucket, tmp_path):
    path, options = bucket
    single = build(seed=3)
    dcp.save(
        dcp_state(*single),
        storage_writer=unbroken.dcp.Writer(path, step=0, storage_options=options),
    )
    run_ranks(_fsdp_job, path, options, str(tmp_path / "out.pt"), world=2, timeout=60)
    out = torch.load(tmp_path / "out.pt", weights_only=True)

    manifest = Directory(open_storage(path, options), path).manifest(1)
    assert manifest.world_size == 2
    # Each rank stored its own 16-row shard of the 32x8 weight and of its Adam moments.
    for key in ("model/0.weight", "optim/state/0.weight/exp_avg"):
        chunks = manifest.tensors[key].chunks
        assert sorted((c.offsets, c.shape, c.file[:6]) for c in chunks) == [
            ([0, 0], [16, 8], "r00000"), ([16, 0], [16, 8], "r00001")
        ]  # fmt: skip
    # 2 -> 1: the shards of step 1 joined in this process (no process group here).
    model_sd, optim_sd = out["saved"]
    assert_same_state(
        model_sd, optim_sd, *load_into_fresh(unbroken.dcp.Reader(path, storage_options=options))
    )
    # 1 -> 2: step 0's whole tensors, each rank reading its rows of every stored block.
    model_sd, optim_sd = out["loaded"]
    assert_same_state(model_sd, optim_sd, *single)


def dcp_payloads(folder) -> dict:
    """Every item of a DCP FileSystemWriter checkpoint: bytes items as stored, tensors as
    loaded (weights only). Unpickles .metadata: only for checkpoints this test wrote."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    items = {}
    for index, info in metadata.storage_data.items():
        raw = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        is_tensor = index.offset is not None
        items[index] = torch.load(io.BytesIO(raw), weights_only=True) if is_tensor else raw
    return items


@pytest.mark.timeout(60)
def test_convert_both_ways_round_trips_bitwise(tmp_path, capsys):
    src, ours, back = tmp_path / "dcp", str(tmp_path / "unbroken"), tmp_path / "back"
    saved = build(seed=0)
    dcp.save(dcp_state(*saved), storage_writer=FileSystemWriter(src))
    assert cli(["convert", str(src), ours, "--to", "unbroken", "--trust-pickle", "--step=5"]) == 0
    assert "warning: unpickling" in capsys.readouterr().err
    assert cli(["verify", ours]) == 0
    assert_same(saved, load_into_fresh(unbroken.dcp.Reader(ours)))

    assert cli(["convert", ours, str(back), "--to", "dcp"]) == 0
    before, after = dcp_payloads(src), dcp_payloads(back)
    assert before.keys() == after.keys()
    for index, value in before.items():
        if isinstance(value, bytes):  # bytes items: the very bytes DCP wrote
            assert after[index] == value, index
        else:
            assert value.dtype == after[index].dtype and torch.equal(value, after[index]), index
    assert_same(saved, load_into_fresh(FileSystemReader(back)))  # DCP's own reader

    # unbroken -> DCP -> unbroken: the same blocks, checksum for checksum.
    assert cli(["convert", str(back), ours, "--to", "unbroken", "--trust-pickle", "--step=6"]) == 0
    directory = Directory(open_storage(ours), ours)
    blocks = [
        {k: [(c.offsets, c.shape, c.xxh3) for c in e.chunks] for k, e in m.tensors.items()}
        for m in (directory.manifest(5), directory.manifest(6))
    ]
    assert blocks[0] == blocks[1] and len(blocks[0]) == 28


@pytest.mark.timeout(30)
def test_convert_refuses_to_unpickle_without_the_flag(tmp_path, capsys):
    src, ran = tmp_path / "dcp", tmp_path / "ran"
    src.mkdir()

    class Payload:  # what a hostile .metadata could hold
        def __reduce__(self):
            return (os.mkdir, (str(ran),))

    (src / ".metadata").write_bytes(pickle.dumps(Payload()))
    assert cli(["convert", str(src), str(tmp_path / "out"), "--to", "unbroken"]) == 2
    err = capsys.readouterr().err
    assert "is a Python pickle" in err and "--trust-pickle" in err
    assert not ran.exists()
    assert Directory(open_storage(str(tmp_path / "out")), "out").steps() == []


@pytest.mark.timeout(60)
def test_example_saves_through_dcp_and_resumes_on_rerun(tmp_path):
    from test_examples import EXAMPLES, run

    script, path = str(EXAMPLES / "dcp.py"), str(tmp_path / "ckpt")
    first = run(script, f"--dir={path}", "--steps=4", "--save-every=2")
    assert first.splitlines()[0] == "starting at step 0" and "step 4: loss" in first
    again = run(script, f"--dir={path}", "--steps=6", "--save-every=2")
    assert again.splitlines()[0] == "resumed from step 4" and "step 6: loss" in again
    assert Directory(open_storage(path), path).steps() == [2, 4, 6]
    assert cli(["verify", "--all", path]) == 0


@pytest.mark.timeout(60)
def test_convert_a_checkpointer_step_to_dcp_loads_with_dcps_own_reader(tmp_path):
    path, out = str(tmp_path / "ckpt"), tmp_path / "dcp"
    model, optim = build(seed=0)
    with unbroken.Checkpointer(path) as ckpt:
        ckpt.save(7, {"model": model, "optim": optim, "progress": unbroken.Progress(epoch=2)})
    assert cli(["convert", path, str(out), "--to", "dcp"]) == 0
    fresh, fresh_optim = build(seed=4)
    state = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict(), "progress": {}}
    state["progress"]["epoch"] = 0
    dcp.load(state, storage_reader=FileSystemReader(out))
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert_same((model, optim), (fresh, fresh_optim))
    assert state["progress"] == {"epoch": 2}
    assert cli(["convert", path, str(out), "--to", "dcp"]) == 2  # exists: --force to replace
