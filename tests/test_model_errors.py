"""``fitlib.model_errors``: a model's failure raised again with what it was
given and, where torch names a layer, which layer and what it expected. The
same errors as ``fit`` shows them are in ``tests/test_core.py``."""

import pytest
import torch
from torch import nn

from fitlib.model_errors import explain_model_error


def explained(model, x):
    """The error ``explain_model_error`` raises for ``model(x)``'s failure,
    and the model's own error."""
    try:
        model(**x) if isinstance(x, dict) else model(x)
    except Exception as e:
        with pytest.raises(Exception) as info:
            explain_model_error(e, model, x)
        return info.value, e
    raise AssertionError("the model did not fail")


def test_an_input_of_the_wrong_size_names_the_layer_and_what_it_expects():
    error, cause = explained(nn.Sequential(nn.Linear(5, 3)), torch.randn(4, 3))
    assert type(error) is ValueError and error.__cause__ is cause
    assert str(error).startswith(
        "layer '0' of the model (Linear(in_features=5, out_features=3, bias=True)) "
        "got input Tensor(shape=(4, 3), float32): it expects 5 features in the "
        "last dimension; the model was called with Tensor(shape=(4, 3), float32)."
    )
    assert f"It said: {cause}" in str(error)


def test_an_index_past_an_embedding_says_how_many_it_has():
    error, _ = explained(nn.Embedding(10, 2), torch.tensor([11]))
    assert type(error) is ValueError
    assert "it expects indices below 10 (num_embeddings)" in str(error)


def test_an_input_of_another_dtype_than_the_layer_is_a_type_error():
    error, _ = explained(nn.Sequential(nn.Linear(5, 3)), torch.randint(0, 3, (4, 5)))
    assert type(error) is TypeError
    assert "layer '0' of the model (Linear(" in str(error)
    assert "has float32 parameters, got input Tensor(shape=(4, 5), int64)" in str(error)


class OwnMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 1))

    def forward(self, x):
        return torch.mm(x, self.w)


def test_float64_inputs_to_a_float32_model_say_which_to_convert():
    error, _ = explained(OwnMatmul(), torch.randn(4, 3, dtype=torch.float64))
    assert type(error) is TypeError
    assert str(error).startswith(
        "the model's parameters are float32 but the input is float64"
    )
    assert "model.double()" in str(error)


class Fails(nn.Module):
    def forward(self, x=None, **inputs):
        raise RuntimeError("my own failure")


def test_another_error_keeps_its_type_with_the_inputs_as_a_note():
    error, cause = explained(Fails(), torch.randn(2, 3))
    assert error is cause
    assert error.__notes__ == [
        "fitlib: the model was called with input Tensor(shape=(2, 3), float32)"
    ]


def test_a_dict_batch_is_said_to_be_the_models_inputs_with_the_fix():
    batch = {"image": torch.randn(2, 3), "label": torch.tensor([0, 1])}
    error, _ = explained(Fails(), batch)
    note = error.__notes__[-1]
    assert "as model(**batch) with the keys ['image', 'label']" in note
    assert "batch_fn=lambda b: (b['image'], b['label'])" in note


def test_a_failed_torch_compile_backend_says_to_use_aot_eager():
    class BackendCompilerFailed(RuntimeError):  # noqa: N818 (torch._dynamo's name)
        pass

    failure = BackendCompilerFailed("backend='inductor' raised:\nCalledProcessError")
    with pytest.raises(RuntimeError) as info:
        explain_model_error(failure, Fails(), torch.randn(2))
    assert str(info.value).startswith(
        "torch.compile's backend could not compile the model (backend='inductor' "
        "raised:). Fix: compile with backend='aot_eager'"
    )
    assert info.value.__cause__ is failure
