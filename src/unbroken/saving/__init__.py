"""Saving: capture and stage in the caller's thread, persist in the background, commit
atomically; the checksums, the claims on a step being written, rank 0's view of the
committed steps and retention's deletions, the per-step save decisions and what happens
at interpreter exit.

    pipeline    `stage()` in the caller's thread, `persist()` in the background
    staging     `Stager`: a reusable, bounded host copy of the state
    planning    `Planner`: rank 0 plans the save, every other rank gets its own part
    checksums   a save's blocks and their checksums, each hashed where it costs least
    claims      which writer is saving a step not yet committed
    committed   `Collector`: the committed steps in memory, deletions in the background
    decisions   `Cadence`: the save policy and preemption, agreed by every rank
    at_exit     saves still persisting at interpreter exit

Entry points: pipeline, staging, committed, decisions, at_exit.
May import: errors, format, job, memory, policies, preemption, restoring, retention, run, sdc,
state, storage.
"""
