"""Checkpoints on a real S3 server (moto's, on loopback), with faults injected by a proxy."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from conftest import make_model, s3_client, train_steps
from servers.faulty_proxy import FaultyProxy
from unbroken import Checkpointer, CheckpointError
from unbroken.storage.pacing import Pacing
from unbroken.storage.s3 import MIN_PART, upload_parts


def _state(seed=0):
    model = make_model(seed)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": model, "optim": optim, "progress": unbroken.Progress(step=0)}


def _big_state():
    return {"w": torch.randn(3 << 20), "b": torch.randn(1000)}  # 12 MiB: a multipart upload


def _uploads(endpoint, uri):
    bucket = uri.removeprefix("s3://").split("/")[0]
    return s3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.fixture(params=["moto", pytest.param("rgw", marks=pytest.mark.rgw)])
def any_bucket(request):
    return request.getfixturevalue("bucket" if request.param == "moto" else "rgw_bucket")


def test_save_and_restore_through_s3(any_bucket):
    uri, options = any_bucket
    state = _state()
    train_steps(state["model"], state["optim"], 2)
    ckpt = Checkpointer(uri, storage_options=options)
    ckpt.save(2, state)
    ckpt.save(3, _big_state() | state, blocking=False).wait()
    assert ckpt.steps() == [2, 3]
    fresh = _state(seed=4)
    assert Checkpointer(uri, storage_options=options).restore(fresh, step=2) == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh["model"].parameters(), state["model"].parameters(), strict=True)
    )


class CountingStorage:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.inner, name)


def test_restore_finds_the_newest_step_without_listing(any_bucket):
    uri, options = any_bucket
    ckpt = Checkpointer(uri, storage_options=options, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state())
    ckpt.wait()  # retention deletes in the background
    assert json.loads(ckpt.storage.read("latest")) == {"step": 3}
    reader = Checkpointer(uri, storage_options=options)
    reader.storage = counting = CountingStorage(reader.storage)
    assert reader.restore(_state()) == 3
    assert "list" not in counting.calls
    assert reader.steps() == [2, 3]  # retention deleted step 1, manifest and data


def test_two_writers_of_one_step_cannot_both_commit(any_bucket):
    uri, options = any_bucket
    first, second = (
        Checkpointer(uri, storage_options=options),
        Checkpointer(uri, storage_options=options),
    )
    first.save(5, {"w": torch.ones(2)})
    manifest = first.storage.read("step-000000005/manifest.json")
    with pytest.raises(FileExistsError):
        second.storage.commit("step-000000005/manifest.json", b"{}")
    with pytest.raises(CheckpointError, match="step 5 is already committed"):
        second.save(5, {"w": torch.zeros(2)})
    assert first.storage.read("step-000000005/manifest.json") == manifest


@pytest.fixture
def proxy(bucket, moto_endpoint):
    proxy = FaultyProxy(moto_endpoint)
    endpoint = proxy.start()
    uri, options = bucket
    yield proxy, uri, options | {"endpoint": endpoint, "retry_timeout": 3.0, "max_retries": 4}
    proxy.stop()


def _part_upload(method, path):
    return method == "PUT" and "partNumber=" in path


def _manifest_put(method, path):
    return method == "PUT" and path.split("?")[0].endswith("manifest.json")


@pytest.mark.parametrize(
    ("kind", "matches", "times"),
    [
        ("503", _part_upload, 3),  # throttled three times: retried
        ("drop", _part_upload, 1),  # connection dropped mid-upload: retried
        ("delay", _manifest_put, 1),  # a slow reply
        ("503", _manifest_put, 2),  # throttled commit: retried
    ],
)
def test_transient_faults_are_retried_and_the_save_commits(
    proxy, moto_endpoint, kind, matches, times
):
    proxy_server, uri, options = proxy
    fault = proxy_server.inject(kind, matches, times=times, seconds=0.5)
    ckpt = Checkpointer(uri, storage_options=options)
    state = _big_state()
    ckpt.save(1, state)
    assert fault.hits == times
    restored = {"w": torch.zeros(3 << 20), "b": torch.zeros(1000)}
    assert Checkpointer(uri, storage_options=options).restore(restored) == 1
    assert torch.equal(restored["w"], state["w"])
    assert _uploads(moto_endpoint, uri) == []


@pytest.mark.parametrize("matches", [_part_upload, _manifest_put])
def test_lasting_faults_fail_cleanly_and_lose_nothing(proxy, moto_endpoint, matches):
    proxy_server, uri, options = proxy
    ckpt = Checkpointer(uri, storage_options=options)
    good = _big_state()
    ckpt.save(1, good)
    proxy_server.inject("503", matches, times=10_000)
    with pytest.raises(CheckpointError, match=r"step-000000002/.*(503|Service Unavailable)"):
        ckpt.save(2, _big_state())
    proxy_server.clear()
    assert _uploads(moto_endpoint, uri) == []
    assert ckpt.steps() == [1]
    restored = {"w": torch.zeros(3 << 20), "b": torch.zeros(1000)}
    assert ckpt.restore(restored) == 1 and torch.equal(restored["w"], good["w"])
    ckpt.save(3, good)  # the next save cleans up after the failed one and commits
    assert ckpt.steps() == [1, 3]
    assert ckpt.storage.list("") == ["latest", "step-000000001", "step-000000003"]


def test_fsspec_urls_work_through_the_fallback_backend(tmp_path):
    uri = f"memory://{tmp_path.name}/ckpt"
    state = _state()
    ckpt = Checkpointer(uri)
    ckpt.save(1, state)
    fresh = _state(seed=3)
    assert Checkpointer(uri).restore(fresh) == 1
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def test_restore_coalesces_reads_across_tensors_and_counts_requests(bucket):
    uri, options = bucket
    state = {f"t{i:02d}": torch.randn(327_680) for i in range(40)}  # 40 x 1.25 MiB
    ckpt = Checkpointer(uri, storage_options=options)
    ckpt.save(1, state)
    saved = ckpt.storage.requests.copy()  # type: ignore[attr-defined]
    assert saved["PUT"] >= 4 and saved["POST"] >= 2  # multipart parts, create + complete
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = Checkpointer(uri, storage_options=options)
    assert reader.restore(fresh) == 1
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    # 50 MiB in pieces of 8 MiB or the part size, whichever is less, on a grid of that
    # size across tensor boundaries: 7 to 11 ranged GETs (the last holds the bytes past
    # the grid's last line that the header pushed there), plus the manifest's; not 40
    assert reader.storage.requests["GET"] <= 11 + 3, reader.storage.requests  # type: ignore[attr-defined]
    # One HEAD: the shard file's size. The pointed step's manifest is read without one.
    assert reader.storage.requests["HEAD"] == 1, reader.storage.requests  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 1 << 36), part_size=st.integers(5 << 20, 1 << 30))
def test_upload_parts_are_even_and_at_least_s3s_smallest(total, part_size):
    """Parts of about the part size, none under S3's 5 MiB but a lone one, and no small
    last part of its own (a shard file's few KB of header once cost a request)."""
    count, part = upload_parts(total, part_size)
    assert (count - 1) * part < max(total, 1) <= count * part  # every byte, no empty part
    assert count == 1 or part >= MIN_PART
    # about the part size asked for (one PUT under 10 MiB: two parts would be under 5 MiB)
    assert part <= part_size * 3 // 2 + 1 or (count == 1 and total < 2 * MIN_PART)
    assert count == 1 or part >= part_size * 3 // 4
    if count > 1:
        assert total - (count - 1) * part >= part - count  # the last part is not a stub


def test_reshard_reads_on_s3_share_requests_across_blocks(bucket):
    """Parts of other blocks (restoring on another number of ranks) go through the same
    planner as whole blocks: 8 blocks of 1.25 MiB back to back in 2 ranged GETs, not 8."""
    uri, options = bucket
    from unbroken.format.layout import step_dir
    from unbroken.format.shards import fill_regions

    state = {f"t{i}": torch.randn(320, 1024) for i in range(8)}
    ckpt = Checkpointer(uri, storage_options=options)
    ckpt.save(1, state)
    m = ckpt.manifest(1)
    out = {k: torch.empty(300, 1024) for k in state}
    targets = [(k, m.tensors[k], m.tensors[k].chunks, out[k], [10, 0]) for k in state]
    before = ckpt.storage.requests["GET"]  # type: ignore[attr-defined]
    fill_regions(ckpt.storage, step_dir(1), targets, threads=2)
    assert all(torch.equal(out[k], state[k][10:310]) for k in state)
    assert ckpt.storage.requests["GET"] - before == 2  # type: ignore[attr-defined]


def test_pacing_measures_round_trips_and_what_a_connection_moves():
    pacing = Pacing()
    pacing.record(8 << 20, 0.1)  # a large request but no round trip yet: nothing to go on
    assert pacing.efficient_bytes() is None and pacing.round_trip is None
    for seconds in (0.031, 0.029, 0.030):
        pacing.record(0, seconds)  # HEADs
    pacing.record(8 << 20, 0.130)  # 30 ms waiting, 100 ms moving 8 MiB
    assert pacing.round_trip == 0.030
    # waiting 30 ms is a tenth of a request of 9 x 30 ms x 80 MiB/s
    assert pacing.efficient_bytes() == pytest.approx(9 * 0.030 * (8 << 20) / 0.100, rel=1e-6)


def test_ranged_gets_grow_with_the_measured_round_trip(bucket, proxy):
    """Behind a proxy that adds 200 ms to every request, the first restore reads 48 MiB in
    GETs of 8 MiB (nothing measured yet); by the second, the storage has measured that a
    GET must be far larger to spend most of its time moving bytes, and reads in GETs of the
    part size (16 MiB): half as many."""
    from unbroken.format.coalesce import MIN_PIECE, rules_for

    uri, direct = bucket
    proxy_server, _, slow = proxy
    state = {"w": torch.randn(12 << 20)}
    Checkpointer(uri, storage_options=direct).save(1, state)
    proxy_server.inject("delay", lambda method, path: True, times=10**6, seconds=0.2)
    reader = Checkpointer(uri, storage_options=slow | {"part_size": 16 << 20})
    storage = reader.storage
    assert rules_for(storage, 48 << 20, 16).most == MIN_PIECE
    gets = []
    for _ in range(2):
        before = storage.requests["GET"]  # type: ignore[attr-defined]
        fresh = {"w": torch.zeros(12 << 20)}
        assert reader.restore(fresh) == 1 and torch.equal(fresh["w"], state["w"])
        gets.append(storage.requests["GET"] - before)  # type: ignore[attr-defined]
    assert storage.pacing.round_trip >= 0.2  # type: ignore[attr-defined]
    assert rules_for(storage, 48 << 20, 16).most == 16 << 20
    assert gets[0] - gets[1] == 3, gets  # 6 GETs of 8 MiB, then 3 of 16 MiB
