"""``unbroken coordinator``'s command line: its options, checked, then
`unbroken.run.coordinator.serve`."""

from __future__ import annotations

import argparse
import sys

from unbroken.run import etcd, gate
from unbroken.run.coordinator import NODE_TIMEOUT_S, SUSPECT_TIMEOUT_S, Where, serve
from unbroken.run.listen import LOOPBACK
from unbroken.run.silence import ANSWER_S, PING_AFTER_S, Silence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unbroken coordinator",
        description="The store of a multi-node `unbroken run --in-process` job: run it "
        "where no training node's loss takes it away (a Kubernetes Deployment), and point "
        "every node's --rdzv-endpoint at it.",
    )
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="the one address to listen on (default: all); beyond loopback, only with the "
        f"job's secret (${gate.SECRET_ENV} or --secret-file) or --insecure",
    )
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"the job's shared secret (default: ${gate.SECRET_ENV}), readable by its owner "
        "only; every node gives the same one",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback with no secret: anyone who reaches the port can read "
        "and change the job's store",
    )
    p.add_argument("--port", type=int, default=29400, help="TCP port (0: any free one)")
    p.add_argument(
        "--etcd",
        metavar="URL",
        help="keep the job's store in etcd (etcd://HOST:PORT,HOST:PORT,.../JOB) instead of "
        "hosting it: no process's loss stops the job; run two coordinators, one leads "
        "(nodes then give the same URL as --rdzv-endpoint)",
    )
    timing(p)
    p.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit once every node finished and every standby saw it (default: serve)",
    )
    return p


def timing(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--node-timeout",
        type=float,
        default=NODE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a node agent silent this long is lost, ping or not (default {NODE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--ping-after",
        type=float,
        default=PING_AFTER_S,
        metavar="SECONDS",
        help="a node agent whose heartbeat is silent this long is pinged, and lost if it "
        f"does not answer within --answer-timeout (default {PING_AFTER_S:g})",
    )
    p.add_argument(
        "--answer-timeout",
        type=float,
        default=ANSWER_S,
        metavar="SECONDS",
        help="how long a silent node agent has to answer the coordinator's ping (default "
        f"{ANSWER_S:g}); raise it for agents starved of CPU",
    )
    p.add_argument(
        "--suspect-timeout",
        type=float,
        default=SUSPECT_TIMEOUT_S,
        metavar="SECONDS",
        help="once a worker reports a lost peer, a node whose agent does not answer the "
        f"coordinator's ping this long is lost (default {SUSPECT_TIMEOUT_S:g})",
    )


def main(argv: list[str]) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.node_timeout <= 0 or a.suspect_timeout <= 0:
        p.error("--node-timeout and --suspect-timeout must be positive")
    try:
        silence = Silence(ping_after_s=a.ping_after, answer_s=a.answer_timeout)
    except ValueError as e:
        p.error(f"--ping-after {a.ping_after:g}, --answer-timeout {a.answer_timeout:g}: {e}")
    try:
        secret = gate.job_secret(a.secret_file)
    except (gate.GateError, OSError) as e:
        p.error(str(e))
    if a.etcd is not None:
        try:
            etcd.parse(a.etcd)
        except ValueError as e:
            p.error(str(e))
    elif secret is None and not a.insecure and a.host not in (LOOPBACK, "localhost", "::1"):
        p.error(
            f"--host {a.host} without a secret would let anyone who reaches the port read "
            f"and change the job's store: set ${gate.SECRET_ENV} (`openssl rand -hex 32`, "
            "the same on every node) or --secret-file, or pass --insecure"
        )
    where = Where(a.host, a.port, secret, a.etcd)
    return serve(where, a.node_timeout, a.suspect_timeout, a.exit_when_done, silence)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
