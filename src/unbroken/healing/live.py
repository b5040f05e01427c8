"""Healing from live replicas: after a failure, the healthy ranks keep their live state
and a replacement gets it from them, losing at most the step in flight.

A rank is *live at step L* if its process survived, its newest per-step record
(`unbroken.healing.records`) is of step L, and its modules and optimizers still match that
record's fingerprint (nothing moved them past L). A rank with no record is *lost* (a
replacement). Healing happens when, at restore:

- every live rank is live at the same step L, and its state is replicated: data-parallel
  (every module entry wrapped by DDP: each rank holds the whole model), or DTensors
  with a replicated mesh dimension (HSDP, FSDP2 on a replicate x shard mesh: the ranks
  holding the same shard in the other replica groups are its replicas, `unbroken.healing.peers`);
- every lost rank's record of L is held by a peer (or rebuilt from its prepared record
  of L, `unbroken.healing.inflight`), and a live rank holds its replica;
- the live replicas of each state (of each shard) are bitwise the same (full checksums;
  a difference is reported as silent data corruption and healing is refused).

Then, with every check passed on every rank before anything changes: each lost rank
receives the module and optimizer tensors (a DTensor's local part) from one live
replica (lost ranks spread over them), point to point on the checkpointer's group,
straight into its tensors, each checked on arrival, and its record from the peer that
holds it; every rank loads its record's per-rank entries (a live rank's own record:
idempotent for objects that survived, a repair for ones built anew). Anything else
(ranks at different steps, a record missing, a pure FSDP shard, every replica of a
shard lost) returns None, and the snapshot path (`unbroken.restoring.pipeline`) runs.

Once loaded, a checksum vote: each replacement hashes the replicated state it now holds
(what ``load_state_dict`` made of what arrived: a model built in another dtype, or a
load hook, would change it) against the full checksums its source described, and every
rank raises a `CheckpointError` naming the rank and tensors if any differs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from unbroken.errors import CheckpointError
from unbroken.format.layout import checksum, dtype_name, verify_block
from unbroken.format.shards import byte_view
from unbroken.healing import inflight, messages, records
from unbroken.healing.messages import Meta
from unbroken.healing.peers import local, replicated_entries, shard_peers
from unbroken.healing.plan import Plan, plan
from unbroken.healing.records import Record
from unbroken.job.comm import Comm
from unbroken.restoring.sources import Origin, Restored
from unbroken.run import faults
from unbroken.state import Captured, capture, init_state, is_stateful, param_indices
from unbroken.tree import decode

log = logging.getLogger("unbroken")


def heal(
    comm: Comm, job: str, state: MutableMapping[str, Any], captured: Captured
) -> tuple[Restored, Record] | None:
    """Heal ``state`` (captured once: ``captured``) from live replicas, or None (nothing
    changed) where it cannot. Collective. Returns what was restored and the record this
    rank loaded. What peers send is checked whole (`unbroken.healing.messages`) inside
    `Comm.together`: a malformed message is a `CheckpointError` on every rank, raised
    before any byte of the state changes."""
    mine = records.own(job, comm.rank)
    shared = replicated_entries(state, captured)
    peers = shard_peers(comm, state, shared.tensors)
    replicas = mine is not None and (
        bool(mine.header.get("data_parallel")) if peers is None else len(peers) > 1
    )
    live = None
    if replicas and mine is not None and records.fingerprint(state) == mine.header["fingerprint"]:
        live = mine.step
    held = {str(o): sorted(s) for o, s in records.held(job).items()}
    flight = None if live is None else inflight.row(job, comm.rank, mine)
    row = {"live": live, "held": held, "peers": peers, "flight": flight}
    chosen = plan(messages.rows(comm.all_gather(row), comm.world_size))
    if chosen is None:
        return None
    meta = _meta(shared) if comm.rank not in chosen.source else None
    gathered = comm.all_gather(None if meta is None else [meta["digest"], peers])
    digests = messages.digests(gathered, comm.world_size)
    if not _agree(digests, chosen.step):
        return None
    record, described, targets, shared = comm.together(
        f"checking the heal of step {chosen.step}",
        lambda: _checked(comm, job, chosen, state, shared, meta, digests, mine),
    )
    faults.point("heal")
    comm.together(f"healing step {chosen.step}", lambda: _receive(comm, chosen, shared, targets))
    comm.together(
        f"loading healed step {chosen.step}",
        lambda: _load(state, shared, described, record, targets),
    )
    comm.together(  # the vote: training goes on only if every replacement is its source
        f"confirming the heal of step {chosen.step}", lambda: _confirm(comm.rank, state, described)
    )
    origins = tuple(
        Origin("live", chosen.step, chosen.source.get(r)) for r in range(comm.world_size)
    )
    log.info("healed step %d from live replicas: ranks %s", chosen.step, sorted(chosen.source))
    return Restored(step=chosen.step, origins=origins, rank=comm.rank), record


def _agree(digests: list[tuple[str, list[int] | None] | None], step: int) -> bool:
    """Whether the live replicas of the same state (under HSDP: the same shard) agree
    bitwise, by their digests."""
    groups: dict[str, set[str]] = {}
    for d in digests:
        if d is not None:
            groups.setdefault(json.dumps(d[1]), set()).add(d[0])
    if any(len(g) > 1 for g in groups.values()):
        log.warning(
            "replicas differ at step %d (digests by rank %s): silent data corruption? "
            "Not healing from them", step, digests,
        )  # fmt: skip
        return False
    return True


def _meta(shared: Captured) -> dict[str, Any]:
    """What a live rank tells a lost one about the replicated entries (``shared``): their
    JSON tree, each tensor's dtype, shape and checksum, and a digest of it all."""
    tensors, tree = shared
    table = []
    for key in sorted(tensors):
        t = local(tensors[key])
        cpu = t if t.device.type == "cpu" and t.is_contiguous() else t.cpu().contiguous()
        table.append([key, dtype_name(t.dtype), list(t.shape), checksum(byte_view(cpu))])
    digest = checksum(memoryview(json.dumps(table).encode()))
    return {"tree": tree, "tensors": table, "digest": digest}


Checked = tuple[Record, Meta | None, dict[str, torch.Tensor], Captured]


def _checked(
    comm: Comm,
    job: str,
    chosen: Plan,
    state: Mapping[str, Any],
    shared: Captured,
    meta: dict[str, Any] | None,
    digests: list[tuple[str, list[int] | None] | None],
    mine: Record | None,
) -> Checked:
    """Send and receive the heal's messages, and check what arrived whole. Returns the
    record this rank loads, what its source described (None on a live rank), where each
    replicated tensor lands (`_targets`) and ``shared`` as refreshed there."""
    got = _messages(comm, job, chosen, meta)
    if got is None:
        assert mine is not None  # a live rank has its own record
        return mine, None, {}, shared
    holder, source = chosen.holder[comm.rank], chosen.source[comm.rank]
    record = Record.decode(got[0], f"rank {holder}")
    if got[2] is not None:  # its prepared record, and its source's record to rebuild it
        _expect(record, comm.rank, chosen.step, f"rank {holder}", "prepared record")
        post = Record.decode(got[2], f"rank {source}")
        _expect(post, source, chosen.step, f"rank {source}", "step record")
        record = inflight.merge(record, post, chosen.rebuilt[comm.rank])
    _expect(record, comm.rank, chosen.step, f"rank {holder}", "step record")
    agreed = digests[source]
    if agreed is None:
        raise CheckpointError(f"rank {source} is to heal rank {comm.rank} but sent no digest")
    described = messages.meta(got[1], source, chosen.step, agreed[0])
    targets, shared = _targets(state, shared, described, record)
    return record, described, targets, shared


def _expect(record: Record, rank: int, step: int, sender: str, what: str) -> None:
    if record.rank != rank or record.step != step:
        raise CheckpointError(
            f"{sender} sent the {what} of rank {record.rank}, step {record.step}; "
            f"expected rank {rank}, step {step}"
        )


def _messages(
    comm: Comm, job: str, chosen: Plan, meta: dict[str, Any] | None
) -> tuple[bytes, bytes, bytes | None] | None:
    """Each rank healed receives its record from its holder (or, where it is rebuilt,
    its prepared record: from itself, if it is a rank behind) and from its source the
    replicated entries' description (and, where it is rebuilt, the source's own record).
    Returns them, unread (None on a rank not healed)."""
    send: dict[int, list[bytes]] = {}
    for healed in sorted(chosen.source):
        if chosen.holder[healed] == comm.rank != healed:
            send.setdefault(healed, []).append(_record_for(job, comm.rank, chosen, healed))
        if chosen.source[healed] == comm.rank:
            assert meta is not None
            send.setdefault(healed, []).append(json.dumps(meta).encode())
            if healed in chosen.rebuilt:
                send[healed].append(records.own(job, comm.rank).data)  # type: ignore[union-attr]
    # One message per pair: holder and source may be the same rank.
    framed = {p: messages.frame(parts) for p, parts in send.items()}
    if comm.rank not in chosen.source:
        records.exchange(comm, framed, [])
        return None
    holder, source = chosen.holder[comm.rank], chosen.source[comm.rank]
    got = records.exchange(comm, framed, sorted({holder, source} - {comm.rank}))
    rebuilt = comm.rank in chosen.rebuilt
    parts = messages.unframe(got[source], 1 + rebuilt + (holder == source), source)
    if holder == source:
        record, parts = parts[0], parts[1:]
    elif holder == comm.rank:
        record = _record_for(job, comm.rank, chosen, comm.rank)
    else:
        record = messages.unframe(got[holder], 1, holder)[0]
    return record, parts[0], parts[1] if rebuilt else None


def _record_for(job: str, rank: int, chosen: Plan, healed: int) -> bytes:
    """On ``healed``'s holder: what it sends ``healed`` as its record."""
    if healed in chosen.rebuilt:
        return inflight.prepared(job, rank, healed, chosen.step - 1)
    return records.held(job)[healed][chosen.step]


def _targets(
    state: Mapping[str, Any], shared: Captured, meta: Meta, record: Record
) -> tuple[dict[str, torch.Tensor], Captured]:
    """On a lost rank: where each replicated tensor lands (the live tensor where it can,
    else a new one, within `messages.fits`), once the source's entries match this rank's
    state exactly; and ``shared`` with any fresh optimizer's new state (`init_state`:
    DTensor state exists to receive into)."""
    names = set(shared.tree)
    if set(meta.tree) != names or not set(record.header["tree"]) <= set(state):
        raise CheckpointError(
            f"the live replica on rank {meta.source} at step {meta.step} holds entries "
            f"{sorted(meta.tree)[:20]} and the step record {sorted(record.header['tree'])[:20]}; "
            f"this rank's state has {sorted(state)[:20]}: build the same state on every rank"
        )
    fresh = [n for n in sorted(names) if isinstance(state[n], Optimizer) and init_state(state[n])]
    shared = shared.refreshed(state, fresh)
    current = shared.tensors
    messages.fits(state, current, meta)
    targets = {}
    for spec in meta.tensors:
        t = None if spec.key not in current else local(current[spec.key])
        if t is not None and list(t.shape) != spec.shape:
            raise CheckpointError(
                f"tensor {spec.key!r} has (local) shape {spec.shape} on the live replica "
                f"(rank {meta.source}, step {meta.step}) but {list(t.shape)} here; build "
                "the model with the same configuration and mesh"
            )
        if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.dtype == spec.dtype:
            targets[spec.key] = t
        elif isinstance(current.get(spec.key), DTensor):
            raise CheckpointError(
                f"the local part of DTensor {spec.key!r} is not a contiguous CPU "
                f"{spec.dtype} tensor here: it cannot receive its replica in place"
            )
        else:
            targets[spec.key] = torch.empty(spec.shape, dtype=spec.dtype)
    return targets, shared


def _receive(comm: Comm, chosen: Plan, shared: Captured, targets: dict[str, torch.Tensor]) -> None:
    """Live sources send their replicated tensors (``shared``) to the lost ranks they
    serve; lost ranks receive them into ``targets``. Keys in sorted order on both ends."""
    ops = []
    serves = sorted(r for r, s in chosen.source.items() if s == comm.rank)
    if serves:
        for key in sorted(shared.tensors):
            t = local(shared.tensors[key])
            t = t if t.device.type == "cpu" and t.is_contiguous() else t.cpu().contiguous()
            for lost in serves:
                ops.append(comm.p2p(dist.isend, t, lost))
    if comm.rank in chosen.source:
        for key in sorted(targets):
            ops.append(comm.p2p(dist.irecv, targets[key], chosen.source[comm.rank]))
    comm.start(ops).wait()


def _load(
    state: MutableMapping[str, Any],
    shared: Captured,
    meta: Meta | None,
    record: Record,
    targets: dict[str, torch.Tensor],
) -> None:
    """Check what arrived, then hand every entry its state: the replicated ones (lost
    ranks only: ``meta``) and this rank's record."""
    if meta is not None:
        for spec in meta.tensors:
            verify_block(
                byte_view(targets[spec.key]), spec.xxh3,
                f"the live replica on rank {meta.source}: tensor {spec.key!r} of step "
                f"{meta.step}", " on arrival",
            )  # fmt: skip
        # A DTensor received its local part in place: the entry is loaded with the DTensor.
        landed = {k: v for k, v in shared.tensors.items() if isinstance(v, DTensor)}
        for name, encoded in meta.tree.items():
            what = f"the live replica on rank {meta.source} at step {meta.step}"
            _hand(state, name, decode(encoded, {**targets, **landed}), what)
    tensors = record.tensors()
    for name, encoded in record.header["tree"].items():
        if name in state:
            _hand(state, name, decode(encoded, tensors), f"the step record of step {record.step}")


def _confirm(rank: int, state: Mapping[str, Any], meta: Meta | None) -> None:
    """On a replacement (``meta``: what its source described): `CheckpointError` unless
    every replicated tensor it holds now has its source's dtype, shape and checksum."""
    if meta is None:
        return
    held = _healed(state, meta)
    wrong = []
    for spec in meta.tensors:
        t = held.get(spec.key)
        if t is None:
            wrong.append(f"{spec.key!r} (not in the state here)")
            continue
        t = local(t)
        if t.dtype != spec.dtype or list(t.shape) != spec.shape:
            here, there = f"{t.dtype}{list(t.shape)}", f"{spec.dtype}{spec.shape}"
            wrong.append(f"{spec.key!r} ({here} here, {there} on rank {meta.source})")
        elif (sum_ := checksum(byte_view(t.cpu().contiguous()))) != spec.xxh3:
            wrong.append(f"{spec.key!r} (checksum {sum_} here, {spec.xxh3} on rank {meta.source})")
    if wrong:
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise CheckpointError(
            f"rank {rank}, healed at step {meta.step}, does not hold what its live replica "
            f"on rank {meta.source} sent: tensors {', '.join(wrong[:5])}{more}. Build the "
            "model and optimizer with the same dtypes (and no load hook that changes "
            "values) on every rank; restart the job to restore from a checkpoint"
        )


def _healed(state: Mapping[str, Any], meta: Meta) -> dict[str, torch.Tensor]:
    """The replicated tensors ``state`` holds now, by captured key: a module's own
    (``keep_vars``), a plain torch optimizer's per-parameter state by its index (what
    `Optimizer.state_dict` packs, without a copy of its groups); any entry that has
    keys neither gives is captured again."""
    found: dict[str, torch.Tensor] = {}
    for name in meta.tree:
        value = state[name]
        if isinstance(value, nn.Module):
            found.update((f"{name}/{k}", t) for k, t in value.state_dict(keep_vars=True).items())
        elif isinstance(value, Optimizer) and _plain(value):
            for i, p in param_indices(value).values():
                for k, t in value.state.get(p, {}).items():
                    found[f"{name}/state/{i}/{k}"] = t
    names = {s.key.split("/", 1)[0] for s in meta.tensors if not torch.is_tensor(found.get(s.key))}
    if names:
        found.update(capture({name: state[name] for name in sorted(names)}).tensors)
    return found


def _plain(optim: Optimizer) -> bool:
    """Whether ``optim.state_dict()`` would hold its per-parameter state as it is."""
    return (
        type(optim).state_dict is Optimizer.state_dict
        and not getattr(optim, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(optim, "_optimizer_state_dict_post_hooks", None)
    )


def _hand(state: MutableMapping[str, Any], name: str, value: Any, source: str) -> None:
    target = state[name]
    try:
        if isinstance(target, nn.Module) or is_stateful(target):
            target.load_state_dict(value)
        elif isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        else:
            state[name] = value
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"entry {name!r} does not take its state from {source} ({str(e)[:300]}): "
            "build the same state on every rank"
        ) from e
