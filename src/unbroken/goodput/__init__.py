"""Goodput: where a training job's time went, and where it would go at scale. The run
directory it reads is `unbroken.run.rundir`.

    account   the arithmetic: every second of every rank given to one cause
    lost      the step spans a kill took from the log, from the step each rank reached
    report    the printed report (and the strings the HTML shows)
    html      the one-file HTML report
    plot      the PNG timeline (matplotlib)
    cli       ``unbroken goodput RUN_DIR``
    simulate  ``unbroken simulate``: goodput at cluster scale, discrete-event

Event names and fields: docs/goodput.md.

Entry points: account, costs, simulate, cli, simulate_cli.
May import: access, policies, run.
"""

from unbroken.goodput.account import Account, account

__all__ = ["Account", "account"]
