"""ClassificationModule(compile=True): the model runs compiled, checkpoints keep plain `model.*` keys."""

import functools

import pytest
import torch

from project.models import ConvNet
from project.module import ClassificationModule


@pytest.mark.slow
@pytest.mark.claim("compile-plain-keys")
def test_compiled_module_state_dict_loads_into_an_uncompiled_model(monkeypatch):
    # The eager backend: dynamo traces the model as with inductor, without minutes of C++ compilation.
    # CompileCounter is that backend with a count of the graphs it was given: the model did run compiled. Imported
    # here, not at collection, where every xdist worker would pay functorch.compile's import.
    from torch._dynamo.testing import CompileCounter

    backend = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    compiled = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8), compile=True)  # compiled in place
    out = compiled(torch.randn(4, 1, 8, 8))
    assert out.shape == (4, 10) and backend.frame_count >= 1
    state = compiled.state_dict()
    assert not any("_orig_mod" in k for k in state)
    plain = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8))
    plain.load_state_dict(state, strict=True)
    compiled.eval(), plain.eval()
    x = torch.randn(2, 1, 8, 8)
    assert torch.allclose(plain(x), compiled(x), atol=1e-5)


@pytest.mark.claim("channels-last-option")
def test_channels_last_option_converts_the_model_and_batches():
    module = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8), channels_last=True)
    conv = module.model.features[0][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    loss, logits, _ = module._shared_step((torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))))
    assert logits.shape == (4, 10) and loss.ndim == 0
