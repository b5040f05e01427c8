"""``unbroken demo``: a tiny GPT trained with DDP under torchrun, SIGKILLed mid-run and
resumed from its last checkpoint, with a bitwise comparison against an uninterrupted run.

`run` drives the demo (``unbroken.demo.run.main``), `train` is one rank of the job and
`model` holds the model and the corpus, which `unbroken.data` tokenises, memory-maps
and reads in a resumable order.

Entry points: run.
May import: data, run, unbroken (the public API, as a training script uses it).
"""

# Prefix of the machine-readable lines that train.py prints and run.py parses. It lives
# here so that run.py does not import torch just to read it.
EVENT_PREFIX = "@demo "
