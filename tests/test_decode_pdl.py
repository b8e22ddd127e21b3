"""The decode step's programmatic dependent launch switch (`graph_decode.DECODE_PDL`): one setting
reaches both the compiled step's kernels (inductor's `triton.enable_pdl`, through torch.compile's
options) and the NF4 kernel's (`Tiles.pdl` while the projections are swapped in), and leaves the
module's tiles as they were. What PDL does on the GPU is tested in
tests/gpu/test_graph_decode_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vlmrl.rollout import graph_decode, nf4_decode
from vlmrl.rollout.graph_decode import GraphDecoding
from vlmrl.rollout.nf4_projections import NF4Decode


def test_the_nf4_kernel_launches_with_pdl_only_while_active_with_it() -> None:
    shipped = nf4_decode.TILES
    nf4 = NF4Decode(torch.nn.Linear(4, 4), layers=[])
    with nf4.active(pdl=True):
        assert nf4_decode.TILES.pdl
        assert nf4_decode.TILES == type(shipped)(**{**vars(shipped), "pdl": True})
    assert nf4_decode.TILES is shipped
    with nf4.active():
        assert nf4_decode.TILES is shipped
    with pytest.raises(RuntimeError, match="step failed"), nf4.active(pdl=True):
        raise RuntimeError("step failed")
    assert nf4_decode.TILES is shipped


@pytest.mark.parametrize("pdl", [False, True])
def test_the_compiled_step_asks_inductor_for_pdl_as_the_default_says(monkeypatch, pdl) -> None:
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compiled.append(kwargs) or model)
    monkeypatch.setattr(graph_decode, "DECODE_PDL", pdl)
    decoding = GraphDecoding(model=torch.nn.Linear(4, 4), original=None)
    assert decoding.pdl is pdl
    assert decoding.compiled is decoding.model
    assert compiled == [{"dynamic": False,
                         "options": {"triton.enable_pdl": True} if pdl else None}]


def test_inductor_knows_the_pdl_option() -> None:
    """torch.compile rejects options inductor does not have: the name must stay inductor's."""
    from torch._inductor import config

    assert "triton.enable_pdl" in config.get_config_copy()


class RecordingNF4:
    """Stands in for an NF4Decode: records each activation's `pdl` (the CPU model has no NF4
    layers to swap)."""

    def __init__(self) -> None:
        self.pdls: list[bool] = []

    def __bool__(self) -> bool:
        return True

    @contextlib.contextmanager
    def active(self, pdl: bool = False):
        self.pdls.append(pdl)
        yield


@pytest.mark.parametrize("pdl", [False, True])
def test_every_decode_step_activates_the_nf4_projections_with_the_decodings_pdl(pdl) -> None:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from vlmrl.models.embedded import ensure_embedded_model

    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    decoding = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model", pdl=pdl)
    decoding.nf4 = recording = RecordingNF4()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        out = decoding._decode(config, {"input_ids": torch.tensor([[1, 2, 3]]),
                                        "attention_mask": torch.ones(1, 3, dtype=torch.long)})
    assert out.shape == (1, 7)
    assert recording.pdls == [pdl] * 3  # the decode steps after the prefill's first token
