"""transformers' ``Trainer`` saving to and resuming from unbroken.

>>> class Trainer(unbroken.hf.trainer.Checkpointing, transformers.Trainer): ...
>>> args = TrainingArguments(output_dir="out", save_steps=50)  # sets up torch.distributed
>>> trainer = Trainer(model=model, args=args, train_dataset=data,
...                   checkpointer=unbroken.Checkpointer("s3://bucket/run", keep=3))
>>> trainer.train(resume_from_checkpoint=True)  # the newest step, if there is one

A mixin rather than a ``TrainerCallback``: the Trainer decides where in the data a run
resumes (how many epochs and batches to skip) from the checkpoint it is handed, before
any callback runs, so a callback can save but cannot resume. The mixin keeps the
Trainer's own resume (its batch skipping, its RNG timing, its callbacks' state) and
replaces only where each piece is read from and written to:

- every save the Trainer schedules (``save_strategy``, ``save_steps``) commits a step
  through the checkpointer in the background: model, optimizer, LR scheduler, gradient
  scaler, each rank's RNG streams and the ``TrainerState`` (as JSON, callbacks' state
  included); retention is the checkpointer's ``keep``, not ``save_total_limit``;
- ``train(resume_from_checkpoint=True)`` (or a step number) restores from the
  checkpointer: memory snapshots and peer replicas where it has them, storage otherwise.
  A path resumes from the Trainer's own folder, as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from transformers.trainer_callback import ExportableState

from unbroken.errors import CheckpointError
from unbroken.hf.accelerate import LaterRNG, unwrapped

if TYPE_CHECKING:
    from unbroken import Checkpointer

_STATE_FILE = "trainer_state.json"  # the one file the Trainer reads from its resume folder
_SINCE = "unbroken_log_since"  # in a step record's TrainerState: its history starts after
log = logging.getLogger(__name__)


class Checkpointing:
    """Put first among the bases: ``class T(Checkpointing, transformers.Trainer)``; takes
    the keyword ``checkpointer``, built after ``TrainingArguments`` (which starts
    torch.distributed) on every rank."""

    def __init__(self, *args: Any, checkpointer: Checkpointer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpointer = checkpointer
        self._rng = LaterRNG()
        self._resume: int | None = None
        self._tensors_due = False
        self._saves: list[tuple[int, int]] = []  # the last two saves: step, log entries
        self._recorded_step: int | None = None
        if self.args.load_best_model_at_end:
            raise CheckpointError(
                "load_best_model_at_end reloads a checkpoint folder of the Trainer's own; "
                "with unbroken's checkpoints, rank them with Checkpointer(keep=KeepBest(...)) "
                "and restore the best step after training"
            )

    # transformers.Trainer's attributes, for the type checker
    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    callback_handler: Any
    control: Any
    hp_search_backend: Any

    def training_state(self, trainer: str | None = None) -> dict[str, Any]:
        """What a step holds: the entries saved and restored, by name; ``trainer`` is the
        TrainerState's JSON (default: all of it)."""
        state: dict[str, Any] = {
            "model": self.model,
            "optim": unwrapped(self.optimizer),
            "sched": self.lr_scheduler,
            "rng": self._rng,
            "trainer": trainer or json.dumps(dataclasses.asdict(self.state), sort_keys=True),
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _recorded(self) -> dict[str, Any]:
        """What each step's record (and a policy's snapshot or save) holds: the log
        history grows with the run, so only the entries after the save before the newest
        go in, with that save's step; a restore finds the rest in a committed save
        (`_history`). Bounded by two save intervals, not O(steps) every step."""
        since, kept = self._saves[0] if len(self._saves) == 2 else (None, 0)
        history = self.state.log_history
        self.state.log_history = history[kept:]
        try:
            fields = dataclasses.asdict(self.state)
        finally:
            self.state.log_history = history
        fields[_SINCE] = since
        return self.training_state(json.dumps(fields, sort_keys=True))

    def _history(self, fields: dict[str, Any], step: int) -> list[dict[str, Any]]:
        """The whole log history up to ``step``, from a restored TrainerState: a save's
        holds it; a record's holds the entries after save ``since``, and the rest comes
        from the newest committed save between the two that holds a whole history. That
        save (or ``step``'s own) is where the next records' histories start."""
        if _SINCE not in fields:
            self._saves = [(step, len(fields["log_history"]))] * 2
            return list(fields["log_history"])
        since, tail = fields.pop(_SINCE), fields["log_history"]
        for saved in reversed(self.checkpointer.steps() if since is not None else ()):
            if since <= saved <= step:
                held = saved_state(self.checkpointer.manifest(saved).objects_for(0))
                if held is not None and _SINCE not in held:
                    self._saves = [(saved, len(held["log_history"]))] * 2
                    return [*held["log_history"], *(h for h in tail if h.get("step", 0) > saved)]
        if since is not None:
            log.warning(
                "step %d's TrainerState holds the log history after step %d only, and no "
                "committed save of steps %d..%d holds the rest: the history starts there",
                step, since, since, step,
            )  # fmt: skip
        return list(tail)

    def train(
        self,
        resume_from_checkpoint: str | bool | int | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` resumes from the
        checkpointer's newest step (and starts afresh where there is none), an ``int``
        from that step."""
        folder = resume_from_checkpoint
        if resume_from_checkpoint is True or type(resume_from_checkpoint) is int:
            step = None if resume_from_checkpoint is True else int(resume_from_checkpoint)
            folder = self._resume_folder(step)
        try:
            output = super().train(  # type: ignore[misc]
                resume_from_checkpoint=folder, trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval, **kwargs,
            )  # fmt: skip
            self.checkpointer.wait()  # a failed background save is raised here
            return output
        finally:
            self._resume = None
            if isinstance(folder, str) and folder != resume_from_checkpoint:
                shutil.rmtree(folder, ignore_errors=True)

    def _resume_folder(self, step: int | None) -> str | None:
        """Restores what exists now and writes the TrainerState where the Trainer reads
        it. An optimizer and scheduler given to the Trainer (``optimizers=``) exist
        already: everything is restored at once, from live replicas too after a fault
        under ``unbroken run --in-process``. Otherwise the Trainer makes them later, and
        the tensors follow then, from the same step."""
        whole = self.optimizer is not None and self.lr_scheduler is not None
        state: dict[str, Any] = (
            self.training_state() if whole else {"trainer": "", "rng": self._rng}
        )
        self._resume = self.checkpointer.restore(state, step, strict=whole)
        if self._resume is None:
            return None
        self._tensors_due = not whole
        self._recorded_step = self._resume
        fields = json.loads(state["trainer"])
        fields["log_history"] = self._history(fields, self._resume)
        folder = tempfile.mkdtemp(prefix="unbroken-trainer-")
        with open(os.path.join(folder, _STATE_FILE), "w") as f:
            json.dump(fields, f, sort_keys=True)
        return folder

    # -- the Trainer's checkpoint reads and writes ------------------------------------

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, evaluation and save of a step, then ``checkpointer.step``:
        the heartbeat and faults of `unbroken run`, the checkpointer's policy (snapshots,
        saves), the record a restore heals from live replicas with. After the log, so
        the record holds the step's entry; once a step (the Trainer comes here again at
        the end of an epoch)."""
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        if self.state.global_step != self._recorded_step:
            self._recorded_step = self.state.global_step
            self.checkpointer.step(self.state.global_step, self._recorded())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):  # as the Trainer's own save records them
                name, held = type(cb).__name__, self.state.stateful_callbacks
                if isinstance(held[name], list):
                    held[name].append(cb.state())
                else:
                    held[name] = cb.state()
        self.checkpointer.save(self.state.global_step, self.training_state(), blocking=False)
        self._saves = [*self._saves[-1:], (self.state.global_step, len(self.state.log_history))]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        if self._tensors_due:  # after accelerate's prepare: FSDP's shards exist too
            self.checkpointer.restore(self.training_state(), self._resume)
            self._tensors_due = False

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        else:  # after the Trainer skipped the batches trained, as its own resume does
            self._rng.apply()


def saved_state(objects: dict[str, Any]) -> dict[str, Any] | None:
    """The TrainerState among a committed save's ``objects`` (its manifest's, rank 0's),
    or None where it holds none (a save made in the same folder by other code): such a
    save is passed over, never an error."""
    text = objects.get("trainer")
    try:
        held = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return held if isinstance(held, dict) and isinstance(held.get("log_history"), list) else None
