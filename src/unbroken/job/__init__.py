"""This process within the job: its rank and the JSON collectives the checkpointer's
ranks agree through, aborting a gloo group stuck on a dead peer, the one background
thread that persists saves in order, and building large object graphs with the garbage
collector paused. Every other library wing stands on it.

    comm        `Comm`: rank, world size, JSON all-gather and broadcast over gloo
    abort       aborting gloo groups whose collectives wait on a failed peer
    transfers   point-to-point transfers, waited for in bounded waits when aborted
    background  `PendingSave`, the save thread, waiting for it
    overlap     a background save's copies beside training, settled before a step
    gc_paused   `building()`: many objects at once with the cyclic collector paused

Entry points: comm, abort, background, gc_paused, overlap, transfers.
May import: errors.
"""
