"""The coordinator's store load at idle, before and after waiting for announcements
(`unbroken.run.news`):

    python bench/recovery_load.py --nodes 4,16 --seconds 3

Per node count, one real `Coordinator` over a real store, and simulated node agents
(threads, one store connection each) that claim their slots, beat every
`unbroken.run.agent.BEAT_S` and look at the store as an idle `NodeAgent` does (its
owner key, the generation counter, the abort key: three requests a look). "poll": the
agents look every `unbroken.run.cli.POLL_S` and the coordinator every
`unbroken.run.coordinator.POLL_S` (as before); "wait": the agents look every
`unbroken.run.agent.LOOK_S` and the coordinator every `look_s`, both at once on an
announcement. Requests are counted in a store wrapper (Python calls) over ``--seconds``
of idle after generation 0 started. Also the time from a worker's report of a lost peer
(appended and announced, as `unbroken.run.inprocess` does) to the coordinator's ping.
Ends with ``RESULT {json}``; docs/scaling.md projects it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from unbroken.run import agent, cli, contract, coordinator, listen
from unbroken.run.news import Listener, announce


class Counted:
    """A store whose requests are counted (``n``), shared by threads."""

    def __init__(self, store: Any, count: list[int]) -> None:
        self._store, self._count = store, count

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._count[0] += 1
            return call(*args, **kwargs)

        return counted


def sim_agent(port: int, slot: int, wait: bool, stop: threading.Event, count: list[int]) -> None:
    import torch.distributed as dist

    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    store = Counted(raw, count)
    me = f"sim-{slot}"
    store.compare_set(contract.slot_key(slot, "owner"), "", me)
    news = Listener("127.0.0.1", port) if wait else None
    every = agent.LOOK_S if wait else cli.POLL_S
    beat = looked = 0.0
    while not stop.wait(0.01):
        now = time.monotonic()
        if now - beat >= agent.BEAT_S:
            store.add(contract.agent_beat_key(me), 1)
            beat = now
        if (news is not None and news.take()) or now - looked >= every:
            store.get(contract.slot_key(slot, "owner"))
            g = int(store.add(contract.GENERATION_KEY, 0))
            store.check([f"{contract.ABORT_KEY}-{g}"])
            looked = now
    if news is not None:
        news.stop(raw)


def measure(nodes: int, wait: bool, seconds: float) -> dict[str, Any]:
    raw = listen.store()
    raw.add(contract.GENERATION_KEY, 0)
    raw.set(contract.JOB_KEY, json.dumps({"nnodes": nodes, "nproc_per_node": 1}))
    counts = {"coordinator": [0], "agents": [0]}
    coord = coordinator.Coordinator(Counted(raw, counts["coordinator"]))
    if wait:
        coord.news = Listener("127.0.0.1", raw.port)
    else:
        coord.look_s = coordinator.POLL_S
    stop = threading.Event()
    sims = [
        threading.Thread(target=sim_agent, args=(raw.port, s, wait, stop, counts["agents"]))
        for s in range(nodes)
    ]
    for t in sims:
        t.start()
    while not coord.started:
        coord.poll()
        time.sleep(coordinator.POLL_S)
    before = {k: v[0] for k, v in counts.items()}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        coord.poll()
        time.sleep(coordinator.POLL_S)
    rates = {f"{k}_per_s": (v[0] - before[k]) / seconds for k, v in counts.items()}
    # A worker's report of a lost peer: how soon the coordinator pings the agents.
    raw.append(f"{contract.SUSPECT_KEY}-0", "0,")
    announce(raw)
    t0 = time.monotonic()
    while coord.suspected is None:
        coord.poll()
        time.sleep(coordinator.POLL_S)
    stop.set()
    for t in sims:
        t.join()
    if coord.news is not None:
        coord.news.stop(raw)
    return {"nodes": nodes, "mode": "wait" if wait else "poll", **rates,
            "report_to_ping_s": time.monotonic() - t0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="4,16")  # 64 threads of agents miss beats on 2 cores
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    rows = [measure(int(n), wait, args.seconds)
            for n in args.nodes.split(",") for wait in (False, True)]  # fmt: skip
    for r in rows:
        print(f"{r['nodes']:>4} nodes, {r['mode']}: coordinator {r['coordinator_per_s']:8.0f}/s, "
              f"agents {r['agents_per_s']:8.0f}/s, report to ping "
              f"{r['report_to_ping_s'] * 1e3:5.1f} ms")  # fmt: skip
    print("RESULT " + json.dumps({"load": rows}))


if __name__ == "__main__":
    main()
