"""Qwen3-VL's processor insists on a video processor, and video processors need torchvision,
which has no CPU build here. Images are all this project feeds the model, so this subclass keeps
Qwen3-VL's image and text handling and leaves video out."""

from __future__ import annotations

from transformers import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin


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
        from vlmrl.embedded import save_processor_files

        save_processor_files(save_directory, self.image_processor, self.tokenizer)
        return []
