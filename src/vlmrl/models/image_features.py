"""A GSPO step runs the policy's vision tower over the same images many times: the generation's
prefill encodes each distinct prompt's image, then every old log-probability pass and every
training micro-batch encodes its rows' images again, each group's image once per row, though a
frozen tower gives the same features each time (a LoRA adapter on the language model leaves it
frozen). With `train.keep_image_features` the tower is wrapped for the training run
(`nn.Module.set_submodule`) so that a call encodes only the images it has not kept and takes the
rest as kept: the features of one generation's images, held until a call brings only new ones
(the next generation's prefill). Images are the same by their grid and a fingerprint of their
patches computed on the device (each patch's sum and each channel's sum, in float32; two
images alike in all of those are taken for one): the kept patches themselves would cost about
as much memory as their features. Served for towers that return
deepstack features (Qwen3-VL's), frozen, without dropout and called for its features alone
(`plain_call`); any other call runs the tower itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vlmrl.errors import ParamsError


@dataclass
class KeptImage:
    """One image's grid, fingerprint and features: the merged tokens and each deepstack level's."""

    grid: tuple[int, ...]
    fingerprint: torch.Tensor
    pooled: torch.Tensor
    deepstack: list[torch.Tensor]


class KeptImageFeatures(torch.nn.Module):
    """The vision tower `tower`, encoding only images it has not kept (see the module)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        super().__init__()
        self.tower = tower
        self.kept: list[KeptImage] = []
        self.asked = 0  # images the calls served here brought
        self.encoded = 0  # of them, those the tower encoded
        self.serves = True  # false once the tower's output has turned out to have no deepstack

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # `dtype`, `spatial_merge_size`, ... as the tower has them
            if name == "tower":
                raise
            return getattr(self.tower, name)

    def servable(self) -> bool:
        """Whether the tower's features stay the same for the same image: no trainable
        parameter, no active dropout."""
        frozen = not any(parameter.requires_grad for parameter in self.tower.parameters())
        dropout = self.tower.training and any(
            isinstance(module, torch.nn.Dropout) and module.p > 0
            for module in self.tower.modules())
        return frozen and not dropout

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        if not (self.serves and plain_call(kwargs) and self.servable()):
            return self.tower(hidden_states, grid_thw=grid_thw, **kwargs)
        grids = [tuple(grid) for grid in grid_thw.tolist()]
        self.asked += len(grids)
        patches = torch.split(hidden_states, [t * h * w for t, h, w in grids])
        prints = [fingerprint(image) for image in patches]
        found = self.find(grids, prints)
        if all(index is None for index in found):
            self.kept = []
        new = [i for i, index in enumerate(found) if index is None]
        if new:
            encoded, output = self.encode(hidden_states, grid_thw, patches, new, grids, prints,
                                          kwargs)
            if encoded is None:  # the first encoding, so of every image: its output as it is
                self.serves = False
                return output
            for i, image in zip(new, encoded):
                found[i] = len(self.kept)
                self.kept.append(image)
        images = [self.usable(self.kept[index]) for index in found]
        return self.output_class(
            last_hidden_state=None, pooler_output=torch.cat([image.pooled for image in images]),
            deepstack_features=[torch.cat(level) for level in
                                zip(*(image.deepstack for image in images))])

    @staticmethod
    def usable(image: KeptImage) -> KeptImage:
        """The image with its features as tensors autograd takes: those kept under
        `torch.inference_mode` are copied once outside it."""
        if image.pooled.is_inference() and not torch.is_inference_mode_enabled():
            image.pooled = image.pooled.clone()
            image.deepstack = [level.clone() for level in image.deepstack]
        return image

    def find(self, grids: list[tuple], prints: list[torch.Tensor]) -> list[int | None]:
        """For each image, the index of the kept image it is, or None; one synchronisation."""
        candidates = [[index for index, kept in enumerate(self.kept) if kept.grid == grid]
                      for grid in grids]
        pairs = [(i, index) for i, found in enumerate(candidates) for index in found]
        if not pairs:
            return [None] * len(grids)
        same = torch.stack([(prints[i] == self.kept[index].fingerprint).all()
                            for i, index in pairs]).tolist()
        found: list[int | None] = [None] * len(grids)
        for (i, index), equal in zip(pairs, same):
            if equal and found[i] is None:
                found[i] = index
        return found

    def encode(self, hidden_states, grid_thw, patches, new: list[int], grids, prints,
               kwargs: dict) -> tuple[list[KeptImage] | None, object]:
        """The new images through the tower, in one call, as KeptImage (None where its output
        has no deepstack features: a tower this does not serve), and the tower's output."""
        if len(new) == len(patches):
            inputs, new_grids = hidden_states, grid_thw
        else:
            inputs = torch.cat([patches[i] for i in new])
            new_grids = grid_thw[torch.tensor(new, device=grid_thw.device)]
        output = self.tower(inputs, grid_thw=new_grids, **{**kwargs, "return_dict": True})
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack is None or getattr(output, "pooler_output", None) is None:
            return None, output
        self.output_class = type(output)
        self.encoded += len(new)
        merge = self.tower.spatial_merge_size ** 2
        sizes = [grids[i][0] * grids[i][1] * grids[i][2] // merge for i in new]
        pooled = torch.split(output.pooler_output.detach(), sizes)
        levels = [torch.split(level.detach(), sizes) for level in deepstack]
        return [KeptImage(grids[i], prints[i], pooled[n], [level[n] for level in levels])
                for n, i in enumerate(new)], output


def plain_call(kwargs: dict) -> bool:
    """Whether a call's options leave the features alone: a returned output object, no
    attentions or hidden states recorded (transformers passes those flags down, off)."""
    return (set(kwargs) <= {"return_dict", "use_cache", "output_attentions",
                            "output_hidden_states"}
            and kwargs.get("return_dict", True) is not False
            and not kwargs.get("output_attentions") and not kwargs.get("output_hidden_states"))


def fingerprint(patches: torch.Tensor) -> torch.Tensor:
    """Each patch's sum and each channel's sum of one image's patches, in float32."""
    return torch.cat([patches.sum(-1, dtype=torch.float32), patches.sum(0, dtype=torch.float32)])


def vision_tower_path(model: torch.nn.Module) -> str:
    """Where the model's vision tower with deepstack features is (under a PEFT wrapper too)."""
    for path, module in model.named_modules():
        if hasattr(module, "deepstack_merger_list") and hasattr(module, "spatial_merge_size"):
            return path
    raise ParamsError(f"params.yaml train.keep_image_features: {type(model).__name__} has no "
                      "vision tower with deepstack features (Qwen3-VL's); set "
                      "train.keep_image_features: false for it")


@contextlib.contextmanager
def kept_image_features(model: torch.nn.Module) -> Iterator[KeptImageFeatures]:
    """The model's vision tower wrapped in KeptImageFeatures while active, put back on exit."""
    path = vision_tower_path(model)
    tower = model.get_submodule(path)
    wrapper = KeptImageFeatures(tower)
    model.set_submodule(path, wrapper, strict=True)
    try:
        yield wrapper
    finally:
        model.set_submodule(path, tower, strict=True)
