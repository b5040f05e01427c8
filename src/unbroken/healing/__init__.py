"""Live healing: after a failure the healthy ranks keep their state and a replacement
gets it from a data-parallel replica, losing at most the step in flight. Per-step records
hold what replicas do not share; DDP's bucket layout is carried so training stays
bitwise.

    stepper      `Stepper`: what `Checkpointer.step` does for healing each step
    live         `heal()`: the plan of who sends what, and sending it
    peers        which ranks hold the same replicated state as this one
    records      per-step records, kept on the rank and on its record peer
    messages     what peers send a heal (rows, records, descriptions), checked whole
    ddp_buckets  DDP's gradient bucket layout across restarts

Entry points: stepper, records.
May import: access, errors, format, job, memory, restoring, run, state, tree.
"""
