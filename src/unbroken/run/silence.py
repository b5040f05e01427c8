"""Finding a node that went silent without closing a connection (a hung kernel, a cut
network, a SIGSTOPped process tree): the coordinator's side of the node agents' beats.

Nothing fails on the survivors when such a node stops: their collectives just wait, so
no worker reports a lost peer. What is left is the agent's beat, a counter it bumps
every `BEAT_S` on a thread of its own (`unbroken.run.news.beat`). The coordinator reads
every watched agent's counter in one request every `Silence.look_s`; an agent whose
counter has not moved for `Silence.ping_after_s` is pinged (`ping`,
answered by the agent's own answering thread, `unbroken.run.news.answer_pings`), and it
is lost only if that ping is not answered within `Silence.answer_s`. So a stopped node
is found in about ``ping_after_s + answer_s`` (0.6-0.7 s by default), while an agent
that is merely late (a loaded CPU, a long GIL hold) still answers a ping that reaches it
in milliseconds and is not lost. ``--node-timeout`` stays as the outer bound.

`Silence` is the policy, a pure object; `Beats` the little state it is applied to.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from unbroken.run import contract

BEAT_S = 0.2  # the node agent's heartbeat to the coordinator
PING_AFTER_S = 0.4  # two beats missed
ANSWER_S = 0.25
LOOK_S = 0.05


class Verdict(Enum):
    ALIVE = "alive"
    PING = "ping"  # silent too long: ask whether it is there
    WAITING = "waiting"  # pinged, the answer window is still open
    LOST = "lost"  # pinged and did not answer


@dataclass(frozen=True, kw_only=True)
class Silence:
    """When the coordinator pings a silent node agent, and when it gives up on it.

    ``ping_after_s``: an agent whose beat has not moved this long is pinged;
    ``answer_s``: a pinged agent that has not answered this long is lost;
    ``look_s``: how often the coordinator reads the beats (one request each time)."""

    ping_after_s: float = PING_AFTER_S
    answer_s: float = ANSWER_S
    look_s: float = LOOK_S

    def __post_init__(self) -> None:
        if self.ping_after_s < BEAT_S:
            raise ValueError(
                f"ping_after_s={self.ping_after_s:g}: an agent beats every {BEAT_S:g} s, so "
                "a shorter silence would ping live agents between two beats; give at least "
                f"{BEAT_S:g} (2 x that is the default)"
            )
        if self.answer_s <= 0 or self.look_s <= 0:
            raise ValueError(
                f"answer_s={self.answer_s:g}, look_s={self.look_s:g}: both must be positive"
            )

    def verdict(self, silent_s: float, pinged_s: float | None) -> Verdict:
        """What to do about an agent whose beat has not moved for ``silent_s``, pinged
        ``pinged_s`` ago (None: no ping of this silence yet)."""
        if pinged_s is not None:
            return Verdict.LOST if pinged_s >= self.answer_s else Verdict.WAITING
        return Verdict.PING if silent_s >= self.ping_after_s else Verdict.ALIVE


DEFAULT = Silence()


def ping(store: Any, agent: str) -> None:
    """Ask ``agent`` to beat at once (`unbroken.run.news.answer_pings` answers). The
    key before this ping's is set again: a coordinator lost between a ping's bump and
    its key (one that took over goes on) would leave the agent deaf to every later one."""
    counter = f"{contract.AGENT_PREFIX}{agent}/{contract.PING_SUFFIX}"
    n = int(store.add(counter, 1))
    keys = [f"{counter}-{i}" for i in range(max(1, n - 1), n + 1)]
    store.multi_set(keys, [""] * len(keys))


class Beats:
    """Each agent's beat counter as the coordinator last saw it, when it last moved, and
    when the agent was pinged for its current silence."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}
        self._pinged: dict[str, float] = {}

    def saw(self, agent: str, count: int, now: float) -> float | None:
        """``agent``'s counter read ``count`` at ``now``: a move ends its silence. How
        long the silence lasted if the move answers a ping (else None)."""
        last = self._seen.get(agent)
        if last is not None and last[0] == count:
            return None
        self._seen[agent] = (count, now)
        answered = self._pinged.pop(agent, None) is not None
        return now - last[1] if answered and last is not None else None

    def moved(self, agent: str) -> float:
        """When ``agent``'s counter last moved (as seen here)."""
        return self._seen[agent][1]

    def pinged(self, agent: str, now: float) -> None:
        self._pinged[agent] = now

    def judge(self, policy: Silence, agent: str, now: float) -> Verdict:
        pinged = self._pinged.get(agent)
        silent = now - self.moved(agent)
        return policy.verdict(silent, None if pinged is None else now - pinged)

    def forget(self, agent: str) -> None:
        self._seen.pop(agent, None)
        self._pinged.pop(agent, None)
