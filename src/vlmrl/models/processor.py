"""The processor every stage feeds the model through, its chat template, and how it is saved.

Qwen3-VL's processor insists on a video processor, and video processors need torchvision, which
has no CPU build here. Images are all this project feeds the model, so where torchvision is
missing `ImageOnlyQwen3VLProcessor` keeps Qwen3-VL's image and text handling and leaves video
out. Processors are always saved the hub's way, so `AutoProcessor` (where torchvision exists) and
llama.cpp's converter read every directory the project writes. Generation never emits vision
tokens: a completion holding `<|image_pad|>` breaks the next forward pass.

A text model (a checkpoint without a vision config, such as Qwen3) has its tokenizer for a
processor. Prompts are stored in the conversational form both kinds share (content as a list of
parts); a text model's chat template (Qwen3's concatenates strings) gets them with each message's
text parts joined into one string (`chat_messages`)."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoProcessor, AutoTokenizer, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from vlmrl.models.distinct_images import distinct_images_class

# Qwen2-VL's image processors (PIL and torchvision backends), which Qwen2.5-VL and Qwen3-VL use.
QWEN_VL_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor",)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def save_pretrained(self, save_directory, **kwargs):
        """Saved the hub way (preprocessor_config.json etc.), never as this class's name."""
        save_processor_files(save_directory, self.image_processor, self.tokenizer)
        return []


def is_text_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint is a language model without a vision tower."""
    return getattr(AutoConfig.from_pretrained(str(path)), "vision_config", None) is None


def load_processor(path: str | Path):
    """`AutoProcessor`, or a Qwen3-VL processor without its video part where torchvision is
    missing (there `AutoProcessor` silently returns a bare tokenizer); a text model's tokenizer.
    A Qwen-VL image processor processes each distinct image of a call once
    (`vlmrl.models.distinct_images`)."""
    if is_text_checkpoint(path):
        return load_text_tokenizer(path)
    if importlib.util.find_spec("torchvision") is None:
        return _image_only_processor(path)
    processor = AutoProcessor.from_pretrained(str(path))
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return _image_only_processor(path)
    if type(image_processor).__name__.startswith(QWEN_VL_IMAGE_PROCESSORS):
        processor.image_processor = distinct_images_class(type(image_processor)).from_pretrained(
            str(path))
    return processor


def _image_only_processor(path: str | Path) -> ImageOnlyQwen3VLProcessor:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    image_processor = distinct_images_class(Qwen2VLImageProcessorPil).from_pretrained(str(path))
    return ImageOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)


def load_text_tokenizer(path: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat template; prompts are chats")
    return tokenizer


def has_vision(processor) -> bool:
    return getattr(processor, "image_processor", None) is not None


def tokenizer_of(processor):
    """The tokenizer of a multimodal processor, or the text model's tokenizer itself."""
    return getattr(processor, "tokenizer", processor)


def chat_messages(processor, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the processor's chat template takes them: unchanged for a vision processor,
    each message's text parts joined into one string for a text model's template."""
    if has_vision(processor):
        return messages
    return [{**message, "content": message_text(message["content"])} for message in messages]


def message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content if part.get("type") == "text")


def render_chat(processor, messages: list[dict[str, Any]]) -> str:
    """The chat-template text of a prompt, ready for the assistant's answer."""
    return processor.apply_chat_template(chat_messages(processor, messages),
                                         add_generation_prompt=True, tokenize=False)


def model_inputs(processor, texts: list[str], images: list | None = None):
    """Tensors for rendered prompts: through the processor with one image per prompt, or the
    tokenizer alone for text-only prompts."""
    if images is None:
        return tokenizer_of(processor)(texts, return_tensors="pt", padding=True,
                                       add_special_tokens=False)
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def vision_token_ids(processor) -> list[int]:
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS]
    return [i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id]


def suppressed_generation_kwargs(processor) -> dict[str, Any]:
    """Generation must never emit vision tokens: a completion holding `<|image_pad|>` breaks the
    next forward pass ("Image features and image tokens do not match")."""
    return {"suppress_tokens": vision_token_ids(processor)}


def chat_template() -> str:
    """Qwen3-VL's chat template, shipped with the package."""
    assets = importlib.resources.files("vlmrl") / "assets"
    return (assets / "qwen3_vl_chat_template.jinja").read_text()


def save_processor_files(out_dir: Path | str, image_processor, tokenizer) -> None:
    """Writes the processor as a hub Qwen3-VL repo lays it out, so `AutoProcessor` where
    torchvision exists, and llama.cpp's `--mmproj` converter, both read it."""
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    preprocessor = out_dir / "preprocessor_config.json"
    config = json.loads(preprocessor.read_text())
    config["processor_class"] = "Qwen3VLProcessor"
    preprocessor.write_text(json.dumps(config, indent=2) + "\n")
    video = {key: config[key] for key in ("patch_size", "temporal_patch_size", "merge_size",
                                           "image_mean", "image_std")}
    video.update(video_processor_type="Qwen3VLVideoProcessor", processor_class="Qwen3VLProcessor",
                 size={"shortest_edge": 4096, "longest_edge": 25165824}, fps=2, min_frames=4,
                 max_frames=768, do_sample_frames=True)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    template = tokenizer.chat_template or chat_template()
    (out_dir / "chat_template.jinja").write_text(template)


def save_processing(out_dir: Path | str, processor) -> None:
    """A vision processor the hub's way (`save_processor_files`), a text model's tokenizer as
    it is (with its chat template)."""
    if has_vision(processor):
        save_processor_files(out_dir, processor.image_processor, processor.tokenizer)
    else:
        processor.save_pretrained(str(out_dir))


def save_with_processor(model, processor, out_dir: Path) -> None:
    """safetensors plus tokenizer, chat template and image processor: a directory that
    AutoModelForImageTextToText (AutoModelForCausalLM for a text model), AutoProcessor and
    llama.cpp's converter each read alone."""
    model.save_pretrained(out_dir)
    save_processing(out_dir, processor)
