"""Restoring: the step every rank agrees on and where each rank's bytes of it come from
(storage, this node's shared memory, a peer's replica), reading them, resharding onto a
different number of ranks, checking and applying them, and leaving the live state as it
was when a restore fails.

    pipeline     `restore()`: the named stages, choose -> check -> read -> share -> apply
    step_choice  the step every rank agrees on, and each rank's source of it
    sources      `StorageSource`, `MemorySource`, the peer replica; `Restored`, `Origin`
    reading      what this rank reads into which memory, from the chosen source
    reshard      which saved state each rank gets when the world changed; `PerRank`
    backup       a failed restore leaves the live state as it was

Entry points: pipeline, sources, reshard.
May import: errors, format, job, memory, run, sdc, state, storage, tree.
"""
