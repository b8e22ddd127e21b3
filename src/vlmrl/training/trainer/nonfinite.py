"""One bad step must not poison a run: in bf16 a loss or gradient can overflow once, and an
optimizer step taken with it writes NaN into the adapter; the next generation then samples from
NaN probabilities and dies in a CUDA assert, far from its cause. As mixed-precision loss scaling
does, a step whose loss or gradient is not finite is skipped (no optimizer or scheduler step, the
weights left as they were) and counted; a run that keeps producing them, or whose weights ever
become non-finite, stops with one line naming the step, the quantity and the settings to look at,
before a checkpoint of it is written.

`NonFiniteGuard` is a mixin for a transformers `Trainer` subclass (vlmrl.training.trainer.trainers): it hooks in
through `training_step`, `create_scheduler`, `log` and a callback, the Trainer's public
extension points. It reads the gradients where the Trainer leaves them, in the parameters (one
process, DDP, FSDP); DeepSpeed (`zero2`, `zero3`) keeps them in its engine and steps inside the
backward, so there the guard sees only the loss and the weights it can read, not the gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import TrainerCallback

from vlmrl.errors import UserError


class NonFiniteTrainingError(UserError):
    """Training produced non-finite values too often, or non-finite weights."""


@dataclasses.dataclass
class NonFiniteState:
    """What the guard knows of the run: the limit, the key that sets it (for the message), the
    skipped steps in total and in a row, and whether the current step is being skipped."""
    limit: int
    key: str
    skipped: int = 0
    in_a_row: int = 0
    skipping: bool = False
    loss_finite: torch.Tensor | None = None  # all micro-batches of the step so far
    last_cause: str = ""


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: FSDP2 shards parameters and gradients as DTensors, whose
    reductions would need a collective; each process checks its shard and `agree` combines."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One boolean tensor (no host sync): whether every element of every tensor is finite."""
    parts = [local(t) for t in tensors]
    if not parts:
        return torch.tensor(True)
    device = parts[0].device
    return torch.stack([torch.isfinite(t).all().to(device) for t in parts]).all()


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity (host syncs: only on failure)."""
    return next((name for name, tensor in named
                 if not bool(torch.isfinite(local(tensor)).all())), None)


def agree(flag: torch.Tensor, device: torch.device | None = None) -> bool:
    """A finiteness flag every process agrees on, the minimum over processes: with sharded
    gradients (FSDP) each process sees only its shard and its own loss, and all must skip the
    same steps. `device`: where the collective runs (the process's GPU under NCCL)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(device or flag.device, torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class GuardCallback(TrainerCallback):
    """Before the optimizer step: skips it when the step's loss or gradient is not finite. At
    the step's end: stops the run when the weights are not finite or too many steps in a row
    were skipped; both happen before the step's checkpoint is saved."""

    def __init__(self, state: NonFiniteState, device_of) -> None:
        self.state = state
        self.device_of = device_of

    def on_train_begin(self, args, state, control, **kwargs):
        counts = [row["nonfinite_steps"] for row in state.log_history if "nonfinite_steps" in row]
        self.state.skipped = int(counts[-1]) if counts else 0  # a resumed run keeps its count

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        guard = self.state
        params = trainable(model)
        grads = [(name, p.grad) for name, p in params if p.grad is not None]
        loss_ok = guard.loss_finite if guard.loss_finite is not None else torch.tensor(True)
        flag = torch.stack([all_finite([g for _, g in grads]).cpu(), loss_ok.cpu()]).all()
        guard.loss_finite = None
        if agree(flag, self.device_of()):
            guard.in_a_row, guard.skipping = 0, False
            return
        guard.last_cause = "the loss" if not bool(loss_ok) else "the gradient norm"
        guard.skipped += 1
        guard.in_a_row += 1
        guard.skipping = True
        for _, p in params:
            p.grad = None  # the optimizer then steps no parameter and keeps its moments
        print(f"step {state.global_step + 1}: {guard.last_cause} is not finite; step skipped "
              f"({guard.in_a_row} in a row, {guard.skipped} in all, limit {guard.limit} in a row: "
              f"{guard.key})", flush=True)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        guard = self.state
        guard.skipping = False
        params = trainable(model)
        if not agree(all_finite([p.detach() for _, p in params]), self.device_of()):
            bad = first_nonfinite([(name, p.detach()) for name, p in params])
            raise NonFiniteTrainingError(
                f"step {state.global_step}: the weight {bad or 'of another process'} is not "
                f"finite; look at the learning rate and model.dtype (bf16 overflows where float32 "
                f"does not); the last checkpoint saved before it is kept")
        if guard.in_a_row >= guard.limit:
            raise NonFiniteTrainingError(
                f"step {state.global_step}: {guard.last_cause} was not finite on {guard.in_a_row} "
                f"steps in a row ({guard.key} = {guard.limit}); look at the learning rate and "
                f"model.dtype (bf16 overflows where float32 does not); the last checkpoint saved "
                f"before it is kept")


class SkippableScheduler:
    """The trainer's learning-rate scheduler, not stepped on a skipped step (a skipped step must
    not move the schedule on, as with loss scaling). Everything else goes to the scheduler."""

    def __init__(self, scheduler, state: NonFiniteState) -> None:
        self.scheduler = scheduler
        self.guard = state

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.guard.skipping:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class NonFiniteGuard:
    """Mixin for a transformers Trainer subclass; `max_nonfinite_steps` and `limit_key` (the
    params key that sets it, for messages) come as keyword arguments."""

    def __init__(self, *args: Any, max_nonfinite_steps: int, limit_key: str,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nonfinite = NonFiniteState(max_nonfinite_steps, limit_key)
        self.add_callback(GuardCallback(self.nonfinite, lambda: self.args.device))

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        except NonFiniteTrainingError:
            # the callbacks' end of training (the progress bar ends its line) before the one line
            self.callback_handler.on_train_end(self.args, self.state, self.control)
            raise

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = torch.isfinite(loss.detach()).all()
        seen = self.nonfinite.loss_finite
        self.nonfinite.loss_finite = finite if seen is None else seen & finite
        return loss

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # ReduceLROnPlateau steps on metrics, not per step, and the Trainer tells it by its type
        if not isinstance(scheduler, (SkippableScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = SkippableScheduler(scheduler, self.nonfinite)
        return self.lr_scheduler

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs or "grad_norm" in logs:  # training rows, not the final summary
            logs["nonfinite_steps"] = self.nonfinite.skipped
        super().log(logs, start_time)
