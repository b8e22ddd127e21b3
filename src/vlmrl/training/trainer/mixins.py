"""The behaviours the project adds to TRL's trainers, one mixin class each, every one through an
overridden method of the trainer (nothing is assigned onto TRL's objects from outside). The
trainer classes themselves are in `vlmrl.training.trainer.trainers`, which puts these in order:
- `CheckedTrainer`: the private TRL names a class relies on, checked when a trainer is made
  (vlmrl.training.trainer.private_names), and TRL's log-prob kernel swapped for a plain-torch
  one where its Triton kernel cannot run (vlmrl.training.trainer.logprob_fallback);
- GRPO only: generation in chunks of rows and compiled decoding, the text decoder layers
  compiled outside generation, each image through the vision tower once a generation, a
  generation batch's pixel values kept in the vision tower's dtype, old log-probabilities only
  for the micro-batches trained off-policy, the rows each process trained on, every rank's RNG
  state written by rank 0, an optimizer state resumed on CPU processes, a finished run restored
  from its checkpoint, and TRL's sample completions table written to a file instead of stdout."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers

from vlmrl.distributed.data_parallel import load_optimizer_state_on_cpu, write_gathered_files
from vlmrl.models.image_features import kept_image_features, vision_tower_path
from vlmrl.training.trainer.chunked_generation import (
    allow_compiling_bnb_4bit,
    compileable_quantizer,
    generate_in_chunks,
)
from vlmrl.training.trainer.compiled_layers import CompiledLayers, text_decoder_layers
from vlmrl.training.trainer.logprob_fallback import TorchChunkedLogProb, kernel_cannot_run
from vlmrl.training.trainer.logs import start_completions_table
from vlmrl.training.trainer.pixel_values import pixels_in, tower_dtype
from vlmrl.training.trainer.private_names import (
    TESTED_VERSIONS,
    PrivateName,
    UpstreamChangedError,
    check_private_names,
)

TRAINED_ROW_COLUMN = "pid"  # the column `trained_rows` records of every row trained on


@contextlib.contextmanager
def log_prob_kernel_for_this_machine() -> Iterator[None]:
    """While it lasts, TRL's fused LM head computes log-probabilities with TorchChunkedLogProb
    where its Triton kernel cannot run. TRL 1.15 reads the kernel from the module global
    `trl.trainer.utils._ChunkedLogProbFunction` at every call and offers no parameter or hook
    for it; the alternatives (a copy of TRL's fused forward put on the model, or the global
    replaced for the whole process) are more invasive than this swap, which lasts one `train`
    or `evaluate` call of the subclass and is undone after it (a private name: checked)."""
    import trl.trainer.utils as trl_utils

    if not kernel_cannot_run(trl_utils._ChunkedLogProbFunction, torch.cuda.is_available()):
        yield
        return
    with mock.patch.object(trl_utils, "_ChunkedLogProbFunction", TorchChunkedLogProb):
        yield


class CheckedTrainer:
    """First in the subclass: checks the private names the class relies on (`PRIVATE_NAMES`)
    on the class it extends (`extends`) before TRL's constructor runs, and trains with the
    log-prob kernel this machine can run."""

    extends: type
    PRIVATE_NAMES: tuple[PrivateName, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_private_names(self.extends, self.PRIVATE_NAMES)
        super().__init__(*args, **kwargs)
        check_private_names(self.extends, self.PRIVATE_NAMES, trainer=self)

    def train(self, *args: Any, **kwargs: Any):
        with log_prob_kernel_for_this_machine():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with log_prob_kernel_for_this_machine():
            return super().evaluate(*args, **kwargs)


class ChunkedGeneration:
    """GRPO generation switches. `generation_rows`: TRL generates a whole generation batch
    (per_device_train_batch_size x steps_per_generation rows) in one `generate` call, so a static
    KV cache is sized for all of it; generating it `generation_rows` at a time keeps the cache,
    and the memory, to one chunk's size, while one batch can still serve several optimizer steps
    (GSPO's off-policy updates). `compile_generation`: TRL builds its generation config with
    `disable_compile=True`, and a static KV cache only pays off with compiled decoding;
    transformers 5.17 also never compiles a bitsandbytes 4-bit model, although that works with
    bitsandbytes 0.50 (measured: benchmarks/gspo_step.py), so under those versions the policy
    gets a copy of its quantizer that allows it (vlmrl.training.trainer.chunked_generation.compileable_quantizer)."""

    def __init__(self, *args: Any, generation_rows: int | None = None,
                 compile_generation: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generation_rows = generation_rows
        self.chunks_announced = False
        if compile_generation:
            self.generation_config.update(disable_compile=False)
            self.allow_compiled_4bit_decoding()

    def allow_compiled_4bit_decoding(self) -> None:
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        quantizer = getattr(model, "hf_quantizer", None)
        compileable = compileable_quantizer(quantizer) if quantizer is not None else None
        if compileable is not quantizer and allow_compiling_bnb_4bit():
            model.hf_quantizer = compileable  # this policy's own quantizer, not the class's

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        generate = super()._generate_single_turn
        rows = self.generation_rows
        if rows is None or len(prompt_ids) <= rows:
            return generate(prompt_ids, images, multimodal_fields, num_generations,
                            has_tool_images)
        if not self.chunks_announced:
            print(f"generating {len(prompt_ids)} rows per generation batch in chunks of {rows}")
            self.chunks_announced = True
        return generate_in_chunks(generate, rows, prompt_ids, images, multimodal_fields,
                                  num_generations, has_tool_images)


class CompiledTrainingLayers:
    """`compile_layers`: while `train` runs, the text decoder layers run compiled in the training
    forward and backward and in the log-probability passes (vlmrl.training.trainer.compiled_layers), and eager in
    generation, whose decode step is compiled, where it is, as a whole."""

    def __init__(self, *args: Any, compile_layers: bool = False, nf4_linears: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiled_layers = (CompiledLayers(text_decoder_layers(self.model),
                                               nf4_linears=nf4_linears)
                                if compile_layers else None)

    def train(self, *args: Any, **kwargs: Any):
        layers = self.compiled_layers
        if layers is None:
            return super().train(*args, **kwargs)
        layers.on()
        print("text decoder layers compiled for training, eager in generation "
              "(train.compile_layers)")
        try:
            return super().train(*args, **kwargs)
        finally:
            layers.off()

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        layers = self.compiled_layers
        with layers.eager() if layers is not None else contextlib.nullcontext():
            return super()._generate_single_turn(*args, **kwargs)


class KeptImagesInTraining:
    """`keep_image_features`: while `train` runs, the policy's vision tower encodes each image once
    a generation and its prefill's features serve the log-probability passes and the training
    micro-batches (vlmrl.models.image_features)."""

    def __init__(self, *args: Any, keep_image_features: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep_image_features = keep_image_features
        self.images_encoded: dict[str, int] | None = None  # after `train`: encoded, asked
        if keep_image_features:
            vision_tower_path(self.model)  # a model without one is refused before training

    def train(self, *args: Any, **kwargs: Any):
        if not self.keep_image_features:
            return super().train(*args, **kwargs)
        with kept_image_features(self.model) as tower:
            print("image features kept through a generation's passes (train.keep_image_features)")
            try:
                return super().train(*args, **kwargs)
            finally:
                self.images_encoded = {"encoded": tower.encoded, "asked": tower.asked}
                print(f"image features: the vision tower encoded {tower.encoded} of the "
                      f"{tower.asked} images its calls brought (train.keep_image_features)")


class PixelValuesInTowerDtype:
    """A generation batch's pixel values kept in the dtype the policy casts them to before its
    vision tower (vlmrl.training.trainer.pixel_values): the same logits, in half the memory on a bfloat16
    policy, through the micro-batches that train on them."""

    def _generate_and_score_completions(self, inputs):
        return pixels_in(super()._generate_and_score_completions(inputs),
                         tower_dtype(self.model))


class OldLogProbsWhereNeeded:
    """Old log-probabilities only for the micro-batches that are trained off-policy. Where one
    generation serves several optimizer steps (steps_per_generation a multiple of
    gradient_accumulation_steps above it), TRL scores every row of it with the policy of
    generation time (`old_per_token_logps`), a forward pass over the whole generation batch; but
    the micro-batches of the first optimizer step are trained before any update, where TRL's loss
    takes the current log-probabilities, detached, as the old ones (its path when generation and
    steps are aligned: the ratio is then exactly 1, where TRL's two passes differed by rounding).
    So the generation-time pass is skipped, and once the batch is shuffled and split into
    micro-batches (TRL's `_buffered_inputs`, a checked private name, whose dicts get the key),
    those used after the first update are scored, still before any update. Served where TRL's
    own trainer is extended (`grpo_class`), KL-free (`beta` 0), with each generation trained on
    once and starting at an optimizer step, and without vLLM's importance sampling; otherwise TRL
    scores every row as it does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_old_logps = False
        self.old_logps_rows = 0  # rows scored by this class (what TRL would score: all of them)

    def old_logps_where_needed(self) -> bool:
        accumulation, generation = (self.args.gradient_accumulation_steps,
                                    self.args.steps_per_generation)
        return (self.beta == 0.0 and self.num_iterations == 1 and generation > accumulation
                and generation % accumulation == 0
                and not (self.use_vllm and self.vllm_importance_sampling_correction))

    def off_policy(self, index: int) -> bool:
        """Whether micro-batch `index` of a generation is trained after an update of the policy
        that generated it (where `old_logps_where_needed`)."""
        return index >= self.args.gradient_accumulation_steps

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        generate_every = self.args.steps_per_generation * self.num_iterations
        generating = self.model.training and (self._step % generate_every == 0
                                              or self._buffered_inputs is None)
        if not generating or not self.old_logps_where_needed():
            return super()._prepare_inputs(generation_batch)
        self.skip_old_logps = True
        try:
            inputs = super()._prepare_inputs(generation_batch)
            if self.skip_old_logps:
                raise UpstreamChangedError(
                    "trl.GRPOTrainer._generate_and_score_completions no longer scores old "
                    "log-probabilities where vlmrl's trainer subclass skips them "
                    f"(OldLogProbsWhereNeeded); tested with trl {TESTED_VERSIONS['trl']}")
        finally:
            self.skip_old_logps = False
        for index, batch in enumerate(self._buffered_inputs):
            if self.off_policy(index):
                batch["old_per_token_logps"] = self.old_logps(batch)
        return inputs

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> tuple:
        if self.skip_old_logps and model is self.model and not torch.is_grad_enabled():
            self.skip_old_logps = False  # generation time's scoring pass: the old log-probs
            return None, None, None
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def old_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's per-token log-probabilities under the current policy, as TRL's loss
        computes them (the same inputs), without gradients or checkpointing."""
        from trl.models.utils import disable_gradient_checkpointing

        completion_ids = batch["completion_ids"]
        input_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        self.old_logps_rows += input_ids.shape[0]
        forward = {key: batch.get(key) for key in MULTIMODAL_INPUTS}
        with torch.no_grad(), disable_gradient_checkpointing(
                self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, completion_ids.size(1),
                batch_size=input_ids.shape[0], **forward)
        return logps


# The inputs TRL's loss passes to the model beside the ids (GRPOTrainer._compute_loss).
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                     "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                     "mm_token_type_ids", "image_position_ids")


class DataParallelRun:
    """What a data-parallel GRPO run needs of its trainer (vlmrl.distributed.data_parallel): `trained_rows`,
    the `pid` of every row this process generated for and trained on, in order (TRL gives each
    process its own rows of a generation batch); every rank's `rng_state_<rank>.pth` written into
    the checkpoint by rank 0 alone (each rank saves to a private temporary directory), so a
    resume finds the files it always did; and a resumed optimizer state loaded onto plain `cpu`
    on CPU processes, where transformers asks `torch.load` for `cpu:<rank>`, a location it
    refuses ("don't know how to restore data location ... cpu:0")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained_rows: list[Any] = []

    def _generate_and_score_completions(self, inputs):
        self.trained_rows.extend(row.get(TRAINED_ROW_COLUMN) for row in inputs)
        return super()._generate_and_score_completions(inputs)

    def _save_rng_state(self, output_dir: str) -> None:
        if self.args.world_size <= 1:
            super()._save_rng_state(output_dir)
            return
        with tempfile.TemporaryDirectory(prefix="vlmrl-rng-") as local:
            super()._save_rng_state(local)
            files = {path.name: path.read_bytes() for path in Path(local).glob("rng_state*.pth")}
        write_gathered_files(files, Path(output_dir), self.accelerator.is_main_process)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        on_cpu_processes = (self.args.world_size > 1 and self.args.device.type == "cpu"
                            and not self.is_deepspeed_enabled and not self.is_fsdp_enabled)
        if checkpoint is None or not on_cpu_processes:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        load_optimizer_state_on_cpu(self.optimizer, self.lr_scheduler, Path(checkpoint))


class RestorableRun:
    """A run whose last checkpoint finished it is restored, not trained on (vlmrl.training.checkpoints.
    train_or_restore): the trainer takes the checkpoint's state and adapter weights."""

    def restore_finished_run(self, checkpoint: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        from transformers import TrainerState

        self.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        weights = load_file(str(checkpoint / "adapter_model.safetensors"))
        unexpected = set_peft_model_state_dict(self.model, weights).unexpected_keys
        if unexpected:  # the fingerprint covers train.lora, so this is a bug, not a user's error
            raise RuntimeError(f"{checkpoint}: adapter weights the model has no place for: "
                               f"{sorted(unexpected)[:3]}")


class CompletionsTableToFile:
    """With `log_completions`, GRPOTrainer.log prints a rich table of sample completions to
    stdout after transformers' `Trainer.log`, burying the stage's own lines; with
    `completions_table` set, stdout goes to that file (appended) while GRPOTrainer.log runs, and
    TrainerLogToStdout, which sits just above transformers' Trainer, gives Trainer.log (the
    progress lines of the callbacks) the real stdout back. The file is created with its header
    line at once, so the declared output exists even with the option off."""

    def __init__(self, *args: Any, completions_table: Path | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completions_table = completions_table
        self.stdout_outside_log = None
        if completions_table is not None and self.accelerator.is_main_process:
            start_completions_table(completions_table)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if (self.completions_table is None or not self.log_completions
                or not self.accelerator.is_main_process):
            super().log(logs, start_time)
            return
        self.stdout_outside_log = sys.stdout
        try:
            with (self.completions_table.open("a", encoding="utf-8") as handle,
                  contextlib.redirect_stdout(handle)):
                super().log(logs, start_time)
        finally:
            self.stdout_outside_log = None


class TrainerLogToStdout(transformers.Trainer):
    """Last base of the GRPO subclass, so that it sits between TRL's trainer and transformers'
    Trainer in the method order: transformers' `log` prints to the stdout of the stage."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        stdout = getattr(self, "stdout_outside_log", None)
        with contextlib.redirect_stdout(stdout) if stdout is not None else contextlib.nullcontext():
            super().log(logs, start_time)
