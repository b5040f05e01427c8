"""Restoring onto another number of ranks: FSDP2 (1-D and a 2-D HSDP mesh) and DDP state
with optimizer state, saved on 4 gloo ranks and restored on 2, 3 and one process without
torch.distributed, and saved on 2 and restored on 3; per-rank state under the rule of
`unbroken.restoring.reshard`; piece checksums on partial reads; version-1 checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import unbroken
from ranks import run_ranks
from test_distributed import CountingReads
from unbroken.errors import CheckpointError, CorruptCheckpointError
from unbroken.format.layout import MANIFEST, PIECE_BYTES, Chunk, Manifest, TensorEntry, step_dir
from unbroken.format.shards import fill, fill_regions
from unbroken.restoring.reshard import PerRank, saved_objects
from unbroken.state import capture
from unbroken.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(240)

KINDS = ("fsdp", "hsdp", "ddp")
ROWS = 2050  # uneven on 4 and 3 ranks; a 4-rank shard (1.3 MB) spans two checksum pieces


def _build(
    kind: str, seed: int, mesh_shape: tuple[int, ...]
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """The model to run (wrapped: DDP, or FSDP2 on a mesh of ``mesh_shape``), the module
    whose state is saved, and its optimizer. No mesh: a plain module, no process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Embedding(ROWS, 640), nn.Linear(640, 5))
    model: nn.Module = inner
    if kind == "ddp" and mesh_shape:
        model = DDP(inner)
    elif kind != "ddp" and mesh_shape:
        names = ("replicate", "shard")[-len(mesh_shape) :]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        fully_shard(inner[0], mesh=mesh)
        fully_shard(inner, mesh=mesh)
    return model, inner, torch.optim.Adam(model.parameters(), lr=0.01)


def _full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of {model, optim} as a full tensor (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    tensors, _ = capture(state)
    return {k: t.full_tensor() if isinstance(t, DTensor) else t.clone() for k, t in tensors.items()}


def _mesh(kind: str, world: int) -> tuple[int, ...]:
    return {"fsdp": (world,), "hsdp": (2, world // 2) if world == 4 else (1, world)}.get(
        kind, (world,)
    )


def _save_job(rank: int, world: int, root: str) -> None:
    from unbroken.state import Progress, RNGState

    for kind in KINDS:
        model, inner, optim = _build(kind, 0, _mesh(kind, world))
        torch.manual_seed(rank)
        model(torch.randint(0, ROWS, (4, 3))).pow(2).mean().backward()
        optim.step()
        state = {"model": inner, "optim": optim, "progress": Progress(step=1)}
        state |= {"rng": RNGState(), "data": Progress(position=100 * rank)}  # per-rank
        full = _full({"model": inner, "optim": optim})
        if rank == 0:
            torch.save(full, os.path.join(root, f"{kind}-{world}.pt"))
        memory = dict(memory=True, memory_dir=f"{root}/shm", job="j") if kind == "ddp" else {}
        ckpt = unbroken.Checkpointer(f"{root}/{kind}-{world}", **memory)  # type: ignore[arg-type]
        ckpt.save(1, state)
        if memory:
            ckpt.snapshot(1, state)
        ckpt.close()


def _restore_job(rank: int, world: int, root: str, sources: tuple[str, ...]) -> dict:
    """Restore each of ``sources`` ("fsdp-4": FSDP2 state saved on 4 ranks); the keys that
    differ from what was saved, and per source where it came from, the bytes this rank
    read against those it holds, and the data positions it was dealt."""
    out: dict = {"wrong": []}
    for source in sources:
        kind = source.split("-")[0]
        _, inner, optim = _build(kind, 7 + rank, _mesh(kind, world) if world > 1 else ())
        data, progress = unbroken.Progress(position=-1), unbroken.Progress(step=0)
        state: dict[str, object] = {"model": inner, "optim": optim, "progress": progress}
        if world > 1:  # per-rank entries: refused until the state says what to do
            try:
                unbroken.Checkpointer(f"{root}/{source}").restore(
                    state | {"rng": unbroken.RNGState(), "data": data}
                )
            except CheckpointError as e:
                out[f"{source} refused"] = str(e)
        state["rng"] = PerRank(unbroken.RNGState(), on_reshard="keep")
        state["data"] = PerRank(data, on_reshard=_positions)
        memory = dict(memory=True, memory_dir=f"{root}/shm", job="j") if kind == "ddp" else {}
        ckpt = unbroken.Checkpointer(f"{root}/{source}", **memory)  # type: ignore[arg-type]
        ckpt.storage = counting = CountingReads(ckpt.storage)
        assert ckpt.restore(state) == 1 and progress.step == 1
        out[source] = {"origin": ckpt.last_restore.origin.kind, "positions": data.position}  # type: ignore[union-attr]
        tensors, _ = capture({"model": inner, "optim": optim})
        out[source]["read"] = counting.reads
        out[source]["needed"] = sum(getattr(t, "_local_tensor", t).nbytes for t in tensors.values())
        if source == "fsdp-4" and world == 2:  # a 2-rank checkpoint of it, for 2 -> 3
            unbroken.Checkpointer(f"{root}/fsdp-2").save(1, state)
        expected = torch.load(os.path.join(root, f"{kind}-4.pt"))
        got = _full({"model": inner, "optim": optim})
        out["wrong"] += [f"{source} {k}" for k in expected if not torch.equal(got[k], expected[k])]
        ckpt.close()
    return out


def _positions(saved: list, rank: int, world: int) -> dict:
    """The data positions of every saved rank, the ones a new rank takes dealt round-robin."""
    return {"position": [s["position"] for s in saved][rank::world]}


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    run_ranks(_save_job, str(root), world=4, timeout=180)
    return root


FROM_4 = ("fsdp-4", "hsdp-4", "ddp-4")


def test_four_ranks_restore_on_two_and_three_and_two_on_three(saved4):
    results = run_ranks(_restore_job, str(saved4), FROM_4, world=2, timeout=180)
    for r in results:
        assert r["wrong"] == []
        assert r["ddp-4"]["origin"] == "storage"  # the 4-rank snapshots in memory do not fit
        refused = r["fsdp-4 refused"]
        assert "saved by 4 ranks and this job has 2: state entry 'data' is per-rank" in refused
        assert "unbroken.PerRank(" in refused
    # Every saved rank's data position goes to exactly one new rank.
    assert [r["fsdp-4"]["positions"] for r in results] == [[0, 200], [100, 300]]
    results = run_ranks(_restore_job, str(saved4), (*FROM_4, "fsdp-2"), world=3, timeout=180)
    assert all(r["wrong"] == [] for r in results)
    assert [r["hsdp-4"]["positions"] for r in results] == [[0, 300], [100], [200]]
    assert [r["fsdp-2"]["positions"] for r in results] == [[[0, 200]], [[100, 300]], []]
    # Each rank reads what overlaps its shards, plus at most a piece at either end of each
    # of the three large tensors (the weight and its two Adam moments).
    for r in results:
        for source in ("fsdp-4", "hsdp-4", "fsdp-2"):
            read, needed = r[source]["read"], r[source]["needed"]
            assert needed <= read <= needed + 2 * PIECE_BYTES * 3 + (1 << 16), source


def test_four_ranks_restore_in_one_process_without_torch_distributed(saved4):
    assert not torch.distributed.is_initialized()
    result = _restore_job(0, 1, str(saved4), FROM_4)
    assert result["wrong"] == [] and result["ddp-4"]["origin"] == "storage"
    assert result["fsdp-4"]["positions"] == [0, 100, 200, 300]


# -- partial reads and checksums ------------------------------------------------------


@pytest.fixture
def big(tmp_path):
    """A one-process checkpoint of a 3-piece tensor, and where its block lies."""
    t = torch.randn(ROWS, 320)  # 2.6 MB: pieces 0-1 whole, piece 2 short
    unbroken.Checkpointer(tmp_path).save(1, {"t": t})
    manifest = json.loads((tmp_path / step_dir(1) / MANIFEST).read_text())
    return tmp_path, t, manifest


def _fill_rows(path, manifest: dict, lo: int, hi: int, storage=None) -> torch.Tensor:
    m = Manifest.from_json(json.dumps(manifest).encode(), "m")
    out = torch.empty(hi - lo, 320)
    storage = storage or LocalStorage(str(path))
    fill(storage, step_dir(1), "t", m.tensors["t"], m.tensors["t"].chunks, out, [lo, 0])
    return out


def test_a_partial_read_reads_and_checks_only_the_pieces_it_needs(big):
    path, t, manifest = big
    chunk = manifest["tensors"]["t"]["chunks"][0]
    assert manifest["version"] == 2 and chunk["piece_bytes"] == PIECE_BYTES
    assert len(chunk["pieces"]) == 3
    counting = CountingReads(LocalStorage(str(path)))
    assert torch.equal(_fill_rows(path, manifest, 10, 20, counting), t[10:20])
    assert counting.reads == PIECE_BYTES  # one piece, not the 2.6 MB block
    # A flipped byte in piece 2 is found by a read that touches it, and named...
    shard = path / step_dir(1) / chunk["file"]
    data = bytearray(shard.read_bytes())
    at = chunk["start"] + 2 * PIECE_BYTES + 1000
    data[at] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't' .* piece 2 of the block"):
        _fill_rows(path, manifest, 1700, 1800)
    # ...and does not stop a read of rows that lie in pieces 0 and 1.
    assert torch.equal(_fill_rows(path, manifest, 0, 1600), t[:1600])
    with pytest.raises(CorruptCheckpointError, match=r"fails its checksum"):
        unbroken.Checkpointer(path).restore({"t": torch.empty_like(t)})


def test_a_version_1_checkpoint_restores_and_checks_whole_blocks(big):
    path, t, manifest = big
    manifest["version"] = 1
    for entry in manifest["tensors"].values():
        for chunk in entry["chunks"]:
            del chunk["pieces"], chunk["piece_bytes"]
    (path / step_dir(1) / MANIFEST).write_text(json.dumps(manifest))
    state = {"t": torch.zeros_like(t)}
    assert unbroken.Checkpointer(path).restore(state) == 1 and torch.equal(state["t"], t)
    chunk = manifest["tensors"]["t"]["chunks"][0]
    shard = path / step_dir(1) / chunk["file"]
    data = bytearray(shard.read_bytes())
    data[chunk["start"] + 2 * PIECE_BYTES + 1000] ^= 0x40
    shard.write_bytes(bytes(data))
    # Without pieces a partial read checks the whole block: the damage elsewhere is found.
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't' in .* fails its checksum"):
        _fill_rows(path, manifest, 10, 20)


class CountingRequests(CountingReads):
    def __init__(self, inner):
        super().__init__(inner)
        self.requests = 0

    def read_into(self, path, offset, out):
        self.requests += 1
        return super().read_into(path, offset, out)

    def read_range(self, path, offset, length):
        self.requests += 1
        return super().read_range(path, offset, length)


def test_parts_of_many_small_blocks_are_fetched_in_one_request(tmp_path):
    state = {f"t{i:02d}": torch.randn(8, 16) for i in range(40)}
    unbroken.Checkpointer(tmp_path).save(1, state)
    m = unbroken.Checkpointer(tmp_path).manifest(1)
    out = {key: torch.empty(4, 16) for key in state}
    targets = [(k, m.tensors[k], m.tensors[k].chunks, out[k], [2, 0]) for k in state]
    storage = CountingRequests(LocalStorage(str(tmp_path)))
    fill_regions(storage, step_dir(1), targets, threads=2)
    assert all(torch.equal(out[k], state[k][2:6]) for k in state)
    assert storage.requests == 1  # 40 blocks back to back, each checked whole
    assert storage.reads == 40 * 8 * 16 * 4


def test_partial_reads_from_s3_fetch_and_check_only_their_pieces(bucket):
    uri, options = bucket
    t = torch.randn(ROWS, 320)
    ckpt = unbroken.Checkpointer(uri, storage_options=options)
    ckpt.save(1, {"t": t})
    m = ckpt.manifest(1)
    out = torch.empty(100, 320)
    storage = CountingRequests(ckpt.storage)
    fill_regions(
        storage, step_dir(1), [("t", m.tensors["t"], m.tensors["t"].chunks, out, [1000, 0])], 2
    )
    assert torch.equal(out, t[1000:1100]) and storage.reads == PIECE_BYTES


class Tied(nn.Module):
    """GPT-2's pattern: the output layer is the token embedding (one storage, two keys)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.lm_head = nn.Embedding(300, 64), nn.Linear(64, 300, bias=False)
        self.lm_head.weight = self.wte.weight


@pytest.mark.parametrize("blocking", [True, False])
def test_tied_tensors_are_stored_once_and_stay_tied(tmp_path, blocking):
    saved = Tied(0)
    with unbroken.Checkpointer(tmp_path) as writer:  # closing waits for a background save
        writer.save(1, {"model": saved}, blocking=blocking)
    manifest = json.loads((tmp_path / step_dir(1) / MANIFEST).read_text())
    chunks = [manifest["tensors"][f"model/{k}.weight"]["chunks"] for k in ("wte", "lm_head")]
    assert chunks[0] == chunks[1]  # both entries name the same bytes
    assert sum(manifest["files"].values()) < 300 * 64 * 4 + 4096
    model = Tied(1)
    ckpt = unbroken.Checkpointer(tmp_path)
    ckpt.storage = counting = CountingReads(ckpt.storage)
    assert ckpt.restore({"model": model}) == 1
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(model.wte.weight, saved.wte.weight) and counting.reads == 300 * 64 * 4


# -- the per-rank rule ----------------------------------------------------------------


def _manifest(trees: list[dict], per_rank_tensor: bool = False) -> Manifest:
    chunks = [Chunk(offsets=[0], shape=[2], ranks=[r]) for r in range(len(trees))]
    tensors = {"m/w": TensorEntry(dtype="F32", shape=[2], chunks=chunks)} if per_rank_tensor else {}
    return Manifest(step=1, world_size=len(trees), created=0.0, tensors=tensors,
                    objects=trees, rank_objects=list(range(len(trees))), files={})  # fmt: skip


@pytest.mark.parametrize(
    ("trees", "state", "rank", "world", "expected"),
    [
        # The same world: rank r takes saved rank r's, whatever differs.
        ([{"d": 1}, {"d": 2}], {"d": None}, 1, 2, ({"d": 2}, set())),
        # Identical on every saved rank: every new rank gets it.
        ([{"p": 5}] * 4, {"p": None}, 2, 3, ({"p": 5}, set())),
        # Per-rank, and the state says keep: left as it is.
        ([{"d": 1}, {"d": 2}], {"d": PerRank(None, "keep")}, 0, 3, ({}, {"d"})),
        # Per-rank, redistributed by the state's function from every saved value.
        (
            [{"d": 1}, {"d": 2}],
            {"d": PerRank(None, lambda s, r, w: s[0] + s[1] + r)},
            2,
            3,
            ({"d": 5}, set()),
        ),
    ],
)
def test_per_rank_rule(trees, state, rank, world, expected):
    assert saved_objects("x", _manifest(trees), state, rank, world) == expected


@pytest.mark.parametrize(
    ("trees", "per_rank_tensor", "state", "match"),
    [
        ([{"d": 1}, {"d": 2}], False, {"d": None}, r"'d' is per-rank \(it holds 2 different"),
        ([{"d": 1}, {}], False, {"d": None}, r"'d' is per-rank \(only saved ranks \[0\] hold"),
        ([{"m": 1}] * 2, True, {"m": None}, r"'m' is per-rank"),
        ([{"m": 1}] * 2, True, {"m": PerRank(None, lambda s, r, w: 1)}, r"'m' holds tensors"),
    ],
)
def test_per_rank_state_is_refused_naming_it(trees, per_rank_tensor, state, match):
    with pytest.raises(CheckpointError, match=match):
        saved_objects("x", _manifest(trees, per_rank_tensor), state, 0, 3)
