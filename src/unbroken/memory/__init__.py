"""Tiers 0 and 1: snapshots in node-local shared memory, and replicas of them in peers'
memory on other nodes, with the folders, names and housekeeping of both.

    tier        `MemoryTier`: this rank's slots and the replicas it keeps for peers
    paths       a job's folder name, rank folders, cleaning abandoned jobs
    partners    who keeps replicas of whose snapshots (pure)
    placement   `place()`: this rank's tier, replica partners and record peer
    replicas    tier 1 traffic: sending snapshots to peers, fetching them back
    snapshots   `Snapshots`: taking one every step, in the background

Entry points: tier, paths, placement, replicas, snapshots.
May import: access, errors, format, job, run, state.
"""
