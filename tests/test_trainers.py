"""The trainer subclasses (vlmrl.training.trainer.trainers): the private TRL and transformers names they rely on
are checked when a trainer is made, and fail in one line where upstream removed or re-signed
one; TRL's sample completions table goes to a file while the progress lines stay on stdout; a
bitsandbytes 4-bit policy's quantizer is copied, not its class changed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trl
import trl.trainer.utils as trl_utils
from transformers.generation.utils import GenerationMixin

from vlmrl.errors import UserError, one_line
from vlmrl.models.loading import load_policy
from vlmrl.params import Params
from vlmrl.training.gspo import build_grpo_config, make_trainer
from vlmrl.training.trainer.mixins import OldLogProbsWhereNeeded
from vlmrl.training.trainer.private_names import (
    GRPO_NAMES,
    OLD_LOGPS_NAMES,
    SFT_NAMES,
    TRAINER,
    UpstreamChangedError,
    check_private_names,
)
from vlmrl.training.trainer.trainers import (
    grpo_class,
    grpo_trainer,
    sft_class,
    sft_trainer,
)

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
PARAMS = Params({"model": {"name": "embedded:tiny-qwen3-vl"},
                 "train": {"save_steps": 100, "lora": LORA}})


def refused(make=grpo_trainer, match: str | None = None) -> UpstreamChangedError:
    """The error making a trainer (`make`: GRPO's by default) raises, before TRL's constructor
    runs, where a private name it relies on is missing or re-signed; `match` its pattern."""
    with pytest.raises(UpstreamChangedError, match=match) as raised:
        make(max_nonfinite_steps=3, model=None)
    return raised.value


def test_the_installed_trl_and_transformers_have_every_name() -> None:
    check_private_names(trl.GRPOTrainer, GRPO_NAMES + OLD_LOGPS_NAMES)
    check_private_names(trl.SFTTrainer, SFT_NAMES)


@pytest.mark.parametrize(("make", "table"), [(grpo_class, GRPO_NAMES + OLD_LOGPS_NAMES),
                                             (sft_class, SFT_NAMES)])
def test_every_private_method_the_subclass_overrides_is_in_the_table(make, table) -> None:
    """A private override missing from the table would go unchecked."""
    subclass = make()
    ours = {name for klass in subclass.__mro__ if klass.__module__.startswith("vlmrl")
            for name in vars(klass) if name.startswith("_") and not name.startswith("__")}
    listed = {row.name for row in table if row.owner == TRAINER}
    assert ours <= listed, sorted(ours - listed)
    assert "_generate_single_turn" in ours or make is sft_class


def test_a_removed_private_method_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")
    error = refused()
    message = str(error)
    assert "\n" not in message and one_line(error) == message
    assert message.startswith("trl.GRPOTrainer._generate_single_turn is missing: ")
    assert "tested with trl 1.15.x and transformers 5.17.x" in message
    assert f"found trl {trl.__version__}, transformers " in message
    assert isinstance(error, UserError)  # a stage prints the line, not a traceback


def test_a_changed_signature_fails_in_one_line(monkeypatch) -> None:
    """What Unsloth does (a replaced `trl.GRPOTrainer`) with a private method re-signed."""

    class Renamed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            raise AssertionError("never called")

    monkeypatch.setattr(trl, "GRPOTrainer", Renamed)
    refused(match=(
        r"^trl\.GRPOTrainer\._generate_single_turn takes \(self, prompt_ids, images, "
        r"multimodal_fields\), not the \(self, prompt_ids, images, multimodal_fields, "
        r"num_generations, has_tool_images\) it was written for: .*trl 1\.15\.x"))


def test_a_pass_through_wrapper_is_checked_for_the_method_it_wraps(monkeypatch) -> None:
    """Unsloth's replacement of trl.GRPOTrainer wraps `_generate_and_score_completions` in a
    `(self, *args, **kwargs)` function without functools.wraps: the check reads the method it
    wraps, further up the class's MRO, and names the class when that one is re-signed."""

    class Concrete(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            raise AssertionError("never called")

    def wrapped(self, *args, **kwargs):
        raise AssertionError("never called")

    wrapper = type("UnslothGRPOTrainer", (Concrete,),
                   {"_generate_and_score_completions": wrapped})
    check_private_names(wrapper, GRPO_NAMES)

    class Resigned(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs, mode):
            raise AssertionError("never called")

    monkeypatch.setattr(trl, "GRPOTrainer", type("UnslothGRPOTrainer", (Resigned,),
                                                  {"_generate_and_score_completions": wrapped}))
    refused(match=(
        r"^trl\.GRPOTrainer\._generate_and_score_completions takes \(self, inputs, mode\), "
        r"not the \(self, inputs\) it was written for: .* \(the class checked: "
        r"test_trainers\.UnslothGRPOTrainer\)$"))


def test_unsloths_replacement_keeps_its_own_scoring(monkeypatch) -> None:
    """Unsloth's GRPOTrainer scores with its own `_get_per_token_logps_and_entropies` (another
    signature, seen on the GPU): its subclass leaves scoring alone and checks none of the names
    only the old-log-prob switch relies on; TRL's own gets the switch and checks them."""

    class Scoring(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                               logits_to_keep, batch_size=None,
                                               compute_entropy=False, compute_efficient=False,
                                               *args, **kwargs):
            raise AssertionError("never called")

    replacement = type("UnslothGRPOTrainer", (Scoring,), {"__module__": "unsloth_compiled_cache"})
    assert OldLogProbsWhereNeeded in grpo_class().__mro__
    monkeypatch.setattr(trl, "GRPOTrainer", replacement)
    subclass = grpo_class()
    assert OldLogProbsWhereNeeded not in subclass.__mro__
    assert not set(OLD_LOGPS_NAMES) & set(subclass.PRIVATE_NAMES)
    check_private_names(replacement, subclass.PRIVATE_NAMES)
    with pytest.raises(UpstreamChangedError, match=r"_get_per_token_logps_and_entropies takes"):
        check_private_names(replacement, OLD_LOGPS_NAMES)


def test_a_removed_module_name_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.delattr(trl_utils, "_ChunkedLogProbFunction")
    refused(sft_trainer, match=r"^trl\.trainer\.utils\._ChunkedLogProbFunction is missing: ")


# Private names of other libraries the package reads (the table covers TRL and transformers).
# gguf-py's GGUFReader reads through `_get` and builds tensors in `_build_tensors`, which the
# export's bounds-checked subclass overrides (vlmrl.export.gguf): the gguf-py of the pinned
# llama-cpp-python's own converter.
OTHER_LIBRARIES = {"_exit": "os", "_dynamo": "torch", "_get": "gguf", "_build_tensors": "gguf"}


def private_names_read(package: Path) -> set[str]:
    """Private attributes the package's source reads on anything but `self` or `cls`, as
    `x._name` or `getattr(x, "_name", ...)`."""
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)
                  and str(node.args[1].value).startswith("_")
                  and not str(node.args[1].value).startswith("__")):
                found.add(node.args[1].value)
    return found


def test_every_private_name_the_package_reads_is_in_the_table() -> None:
    """A private TRL or transformers name called or read outside the table would go unchecked
    (graph decoding's position helper and attention attribute among them)."""
    import vlmrl

    read = private_names_read(Path(vlmrl.__file__).parent)
    listed = {row.name for row in GRPO_NAMES + OLD_LOGPS_NAMES + SFT_NAMES}
    assert read - set(OTHER_LIBRARIES) <= listed, sorted(read - set(OTHER_LIBRARIES) - listed)
    assert "_prepare_position_ids_for_generation" in read  # the scan sees calls on expressions


def test_a_removed_generation_helper_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.delattr(GenerationMixin, "_prepare_position_ids_for_generation")
    refused(match=(
        r"^transformers\.GenerationMixin\._prepare_position_ids_for_generation is missing: "
        r".*tested with trl 1\.15\.x and transformers 5\.17\.x"))


def test_a_bnb_4bit_quantizer_is_copied_with_compiling_allowed() -> None:
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from vlmrl.training.trainer.chunked_generation import compileable_quantizer

    original = Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True))
    copy = compileable_quantizer(original)
    assert isinstance(copy, Bnb4BitHfQuantizer) and copy.is_compileable is True
    assert vars(copy) == vars(original) and original.is_compileable is False
    assert Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True)).is_compileable is False
    assert compileable_quantizer(copy) is copy and compileable_quantizer(None) is None


def answer_length(completions, **columns) -> list[float]:
    return [float(len(str(c))) for c in completions]


def test_completions_table_goes_to_the_file_and_progress_to_stdout(train_set, tmp_path: Path,
                                                                   capsys) -> None:
    pytest.importorskip("rich")
    grpo = {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 4, "logging_steps": 1, "seed": 3, "report_to": "none",
            "log_completions": True, "num_completions_to_print": 2}
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, 3)
    config = build_grpo_config(grpo, output_dir=tmp_path / "run", save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    samples = tmp_path / "reports" / "train_samples.txt"
    trainer = make_trainer(model.train(), processor, config, train_set, [answer_length],
                           generation_rows=None, callbacks=[], completions_table=samples)
    assert samples.read_text(encoding="utf-8").startswith("Sample completions")
    trainer.train()

    out = capsys.readouterr().out
    text = samples.read_text(encoding="utf-8")
    assert "Step 1" in text and "Advantage" in text  # the table's title and a column
    assert "Step 1" not in out and "Advantage" not in out
    assert "'reward'" in out  # transformers' progress line of the step, on stdout
    assert len(trainer.trained_rows) == 4
    assert list((tmp_path / "run" / "completions").glob("*.parquet"))


@pytest.mark.parametrize("compile_layers", [False, True])
def test_compiled_runs_freeze_the_heap_after_their_first_step(train_set, tmp_path: Path,
                                                              compile_layers) -> None:
    from vlmrl.training.trainer.compiled_layers import FrozenHeapAfterFirstStep

    grpo = {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 4, "seed": 3, "report_to": "none"}
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, 3)
    config = build_grpo_config(grpo, output_dir=tmp_path / "run", save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [answer_length],
                           generation_rows=None, callbacks=[], compile_layers=compile_layers)
    frozen = [callback for callback in trainer.callback_handler.callbacks
              if isinstance(callback, FrozenHeapAfterFirstStep)]
    assert len(frozen) == int(compile_layers)


@pytest.mark.parametrize("options", [{"use_reentrant": True}, {"use_reentrant": False}])
def test_the_runs_checkpointing_options_hold_after_each_generation(train_set, tmp_path: Path,
                                                                     monkeypatch, options) -> None:
    """TRL turns checkpointing back on after generating with transformers' defaults, and its
    scoring pass after that with the run's options: every checkpointed layer call of the
    training micro-batches gets the run's options."""
    from transformers import modeling_utils

    calls: list[bool] = []
    checkpoint = modeling_utils.checkpoint

    def recording_checkpoint(function, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", recording_checkpoint)
    grpo = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 4, "seed": 3, "report_to": "none",
            "gradient_checkpointing": True, "gradient_checkpointing_kwargs": dict(options)}
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, 3)
    config = build_grpo_config(grpo, output_dir=tmp_path / "run", save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [answer_length],
                           generation_rows=None, callbacks=[])
    trainer.train()
    layers = model.get_base_model().config.text_config.num_hidden_layers
    assert len(calls) >= 2 * layers  # two steps, each after its own generation
    assert set(calls) == {options["use_reentrant"]}
