"""Hugging Face training loops through unbroken: `unbroken.hf.trainer` (transformers'
``Trainer``) and `unbroken.hf.accelerate` (Accelerate's ``save_state``/``load_state``).

Each is imported on its own, so neither needs the other's library installed (the trainer
needs Accelerate, as transformers' Trainer does).

Entry points: trainer, accelerate.
May import: unbroken, errors, state.
"""
