"""The checkpoint format and the bytes under it: step folders, shard files in safetensors
layout, the JSON manifest and its validation, the committed-step directory on any
storage, and moving tensor bytes between memory and shard files (block IO, read
requests, the write plan). It knows nothing of saving, restoring or memory tiers.

    layout      the on-storage format: step folders, shard files, the manifest
    validate    a parsed manifest checked before anything it names is read
    directory   which steps are committed, their manifests, ``latest``, deletion
    blockio     a tensor's bytes as a buffer, byte ranges read with named errors
    coalesce    byte ranges -> read requests (merged, split, issued)
    shards      tensor bytes between memory and shard files
    write_plan  who writes what: every rank's blocks -> a write plan (pure)
    offline     whole-checkpoint work in one process: consolidating weights
    audit       every stored byte of a step re-read and checked (`unbroken verify`)
    marks       a step's suspect mark (divergent replicas), read without torch

Entry points: layout, validate, directory, blockio, shards, write_plan, offline, audit,
marks.
May import: errors, job, run, storage.
"""
