"""ProgressiveResizing: training images resized by a schedule of epochs, in
few sizes, exact on resume; validation at the loader's size."""

from pathlib import Path

import pytest
import torch
from helpers import Crash
from recipes_child import killed_and_resumed_equal
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from fitlib import Callback, DataBunch, HPOptimizer, Learner, fit
from fitlib.callbacks import ChannelsLast, Checkpoint, Compile, ProgressiveResizing
from fitlib.callbacks import CudaGraph as FitlibCudaGraph

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).parent


def images(n=64, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, size, size, generator=g)
    return TensorDataset(x, (x[:, 0].mean((1, 2)) > 0.5).long())


def image_data(n=64, bs=16, size=32, **kwargs):
    return DataBunch(
        DataLoader(images(n, size), bs, shuffle=True, **kwargs),
        DataLoader(images(32, size, seed=1), bs),
        device="cpu",
    )


def convnet(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


class Shapes(Callback):
    """The image shape each batch reached the model with, by epoch and mode."""

    def __init__(self):
        self.train, self.valid = {}, {}

    def on_batch_begin(self, last_input, train, epoch):
        seen = self.train if train else self.valid
        seen.setdefault(epoch, set()).add(tuple(last_input.shape[-2:]))


def run(epochs, *callbacks, data=None, model=None):
    model = model or convnet()
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return fit(epochs, model, F.cross_entropy, opt, data or image_data(),
               callbacks=list(callbacks))  # fmt: skip


# -- the schedule ------------------------------------------------------------------
def test_sizes_by_epoch_hold_until_the_next_epoch_given():
    grow = ProgressiveResizing(sizes={0: 16, 3: (24, 20), 5: 32})
    assert grow.schedule(7) == [(16, 16)] * 3 + [(24, 20)] * 2 + [(32, 32)] * 2


def test_start_to_end_grows_in_buckets_rounded_and_ends_at_the_exact_end():
    grow = ProgressiveResizing(start=64, end=100, buckets=4, until=0.8)
    sizes = grow.schedule(10)
    assert sizes[-2:] == [(100, 100)] * 2  # the last fifth: the end, not rounded
    assert all(h % 8 == 0 for h, _ in sizes[:-2])  # the others: multiples of 8
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    coarse = ProgressiveResizing(start=64, end=100, buckets=4, multiple_of=32)
    assert len(set(coarse.schedule(10))) < 4  # 76 and 88 round to 64 and 96


def test_the_last_epoch_is_at_the_end_size_even_in_a_short_fit():
    grow = ProgressiveResizing(start=16, end=32, buckets=3)
    assert grow.schedule(2) == [(16, 16), (32, 32)]
    assert grow.schedule(1) == [(32, 32)]


def test_start_and_end_are_kept_as_given_only_the_sizes_between_are_rounded():
    grow = ProgressiveResizing(start=20, end=60, buckets=3, until=0.5)
    assert grow.schedule(4) == [(20, 20), (40, 40), (60, 60), (60, 60)]
    odd = ProgressiveResizing(start=(4, 6), end=(9, 30), buckets=3, until=0.5)
    assert odd.schedule(4) == [(4, 6), (8, 16), (9, 30), (9, 30)]  # (6.5, 18)


def test_a_start_below_multiple_of_trains_at_that_size():
    shapes = Shapes()
    data = image_data(size=8)
    run(2, ProgressiveResizing(start=4, buckets=2, until=0.5), shapes, data=data)
    assert shapes.train == {0: {(4, 4)}, 1: {(8, 8)}}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 40, "end": 32}, r"start=\(40, 40\) is not smaller than end="),
        ({"start": (16, 40), "end": 32}, r"start=\(16, 40\) is not smaller than"),
        ({"start": 32, "end": 32}, r"every epoch would train at \(32, 32\)"),
    ],
)
def test_refuses_a_start_not_smaller_than_the_end(kwargs, match):
    with pytest.raises(ValueError, match=match + r".*Fix: "):
        ProgressiveResizing(**kwargs)


@pytest.mark.parametrize("start", [32, 40])
def test_refuses_a_start_not_smaller_than_the_images_before_any_step(start):
    model = convnet()
    before = [p.detach().clone() for p in model.parameters()]
    want = rf"start=\({start}, {start}\) (is not smaller than|equals) the images' "
    with pytest.raises(ValueError, match=want + r"own size \(32, 32\)"):
        run(2, ProgressiveResizing(start=start), model=model)
    assert all(map(torch.equal, before, model.parameters()))


@pytest.mark.parametrize(
    "grow",
    [
        {"start": 16},  # a fit of one epoch: the last is at the end
        {"start": 16, "until": 0.2},  # until: every epoch of 2 at the end
        {"sizes": {0: 32}},  # the images' own size
    ],
)
def test_warns_when_every_epoch_of_the_fit_trains_at_full_size(grow):
    epochs = 1 if grow == {"start": 16} else 2
    with pytest.warns(UserWarning, match=r"every epoch of this fit trains at the "
                      r"images' full size \(32, 32\)"):  # fmt: skip
        run(epochs, ProgressiveResizing(**grow))


# -- through fit ---------------------------------------------------------------------
def test_training_batches_follow_the_schedule_and_validation_keeps_full_size():
    shapes = Shapes()
    run(4, ProgressiveResizing(start=16, buckets=2, until=0.5), shapes)
    assert shapes.train == {0: {(16, 16)}, 1: {(16, 16)}, 2: {(32, 32)},
                            3: {(32, 32)}}  # fmt: skip
    assert all(seen == {(32, 32)} for seen in shapes.valid.values())


def test_a_batch_is_resized_as_bilinear_interpolation_with_antialias():
    seen = []
    keep = Callback.from_hooks(on_batch_begin=lambda last_input, train: seen.append(
        last_input) if train else None)  # fmt: skip
    data = DataBunch(DataLoader(images(16), 16), device="cpu")
    run(1, ProgressiveResizing(sizes={0: (12, 20)}), keep, data=data)
    want = F.interpolate(images(16).tensors[0], size=(12, 20), mode="bilinear",
                         antialias=True, align_corners=False)  # fmt: skip
    assert torch.equal(seen[0], want)


def test_growing_past_the_images_size_interpolates_without_antialias():
    seen = []
    keep = Callback.from_hooks(on_batch_begin=lambda last_input, train: seen.append(
        last_input) if train else None)  # fmt: skip
    data = DataBunch(DataLoader(images(16, size=8), 16), device="cpu")
    run(1, ProgressiveResizing(sizes={0: 16}), keep, data=data)
    want = F.interpolate(images(16, size=8).tensors[0], size=(16, 16),
                         mode="bilinear", align_corners=False)  # fmt: skip
    assert torch.equal(seen[0], want)


def test_the_resized_images_reach_channels_last_in_its_layout():
    seen = []
    keep = Callback.from_hooks(on_loss_begin=lambda last_input, train: seen.append(
        last_input) if train else None)  # fmt: skip
    run(1, ProgressiveResizing(sizes={0: 16}), ChannelsLast(), keep)
    assert seen[0].shape[-2:] == (16, 16)
    assert seen[0].is_contiguous(memory_format=torch.channels_last)


def test_a_learners_evaluation_sees_the_loaders_images():
    model = convnet()
    learn = Learner(image_data(), model, F.cross_entropy, progress=False,
                    callbacks=[ProgressiveResizing(sizes={0: 8})])  # fmt: skip
    learn.fit(1, lr=0.1)
    seen = set()
    model.register_forward_pre_hook(lambda m, args: seen.add(args[0].shape[-2:]))
    learn.get_preds()
    learn.validate()
    assert seen == {(32, 32)}


# -- refusals, before any step -----------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sizes": {0: 64.0}}, TypeError, r"sizes\[0\] must be an int >= 1 or a "),
        ({"sizes": {0: (64, 0)}}, TypeError, r"got \(64, 0\) \(tuple\)"),
        ({"sizes": {0.5: 64}}, TypeError, r"each epoch of sizes must be an int"),
        ({"sizes": {2: 64}}, ValueError, r"must give the size of epoch 0; got epochs"),
        ({"sizes": [64, 96]}, TypeError, r"sizes must be a non-empty dict"),
        ({"start": "64"}, TypeError, r"start must be an int >= 1 or a \(height"),
        ({"start": 64, "end": 96.5}, TypeError, r"end must be an int"),
        ({}, TypeError, r"give either sizes=\{epoch: size\} or start="),
        ({"sizes": {0: 8}, "start": 8}, TypeError, r"give either sizes="),
        ({"start": 8, "buckets": 0}, ValueError, r"buckets must be an int >= 1"),
        ({"start": 8, "until": 1.5}, ValueError, r"until must be a fraction .* \(0,"),
        ({"start": 8, "until": 0}, ValueError, r"until must be a fraction"),
        ({"start": 8, "mode": "bilinar"}, ValueError, r"did you mean 'bilinear'"),
        ({"start": 8, "antialias": "no"}, TypeError, r"antialias must be True or"),
    ],
)
def test_refuses_bad_arguments_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        ProgressiveResizing(**kwargs)


def test_a_schedule_to_the_images_own_size_needs_that_size():
    grow = ProgressiveResizing(start=8)
    with pytest.raises(ValueError, match=r"schedule\(10, full=\(224, 224\)\)"):
        grow.schedule(4)
    assert grow.schedule(4, full=16)[-1] == (16, 16)
    with pytest.raises(ValueError, match=r"n_epochs must be an int >= 1; got 0"):
        grow.schedule(0, full=16)


def test_refuses_a_batch_without_images_before_any_step(data, model):
    before = [p.detach().clone() for p in model.parameters()]
    opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"none is a 4-D float tensor \(B, C, H, W"
                       r"\).*Fix: leave ProgressiveResizing out"):  # fmt: skip
        fit(1, model, F.cross_entropy, opt, data, [ProgressiveResizing(sizes={0: 8})])
    assert all(map(torch.equal, before, model.parameters()))


def test_refuses_uint8_images_with_the_fix():
    pixels = TensorDataset(torch.randint(0, 255, (16, 3, 8, 8), dtype=torch.uint8),
                           torch.zeros(16, dtype=torch.long))  # fmt: skip
    with pytest.raises(ValueError, match=r"divides uint8 pixels by 255"):
        run(1, ProgressiveResizing(sizes={0: 4}),
            data=DataBunch(DataLoader(pixels, 8), device="cpu"))  # fmt: skip


def test_refuses_targets_the_size_of_the_images():
    masks = TensorDataset(torch.rand(16, 3, 8, 8), torch.zeros(16, 8, 8).long())
    seg = nn.Conv2d(3, 2, 1)
    with pytest.raises(ValueError, match=r"height and width \(8, 8\) \(masks\?\)"):
        run(1, ProgressiveResizing(sizes={0: 4}), model=seg,
            data=DataBunch(DataLoader(masks, 8), device="cpu"))  # fmt: skip


def test_start_and_end_need_the_fits_epochs():
    with pytest.raises(ValueError, match=r"gives none \(max_steps alone\)"):
        model = convnet()
        opt = HPOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        fit(None, model, F.cross_entropy, opt, image_data(),
            callbacks=[ProgressiveResizing(start=16)], max_steps=3)  # fmt: skip


class CudaGraph(Callback):
    """Stands for fitlib's CudaGraph (which needs CUDA): known by its name."""


def test_refuses_cuda_graphs_with_several_sizes_before_any_step():
    # a graph captured at the first size would replay none of the later ones
    model = convnet()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"CudaGraph captures one shape.*sizes "
                       r"\(8, 8\), \(32, 32\).*Fix: "):  # fmt: skip
        run(2, ProgressiveResizing(sizes={0: 8, 1: 32}), CudaGraph(), model=model)
    assert all(map(torch.equal, before, model.parameters()))
    with pytest.raises(ValueError, match=r"CudaGraph captures one shape"):
        run(4, ProgressiveResizing(start=16, buckets=2), CudaGraph())
    # fitlib's own, refused before it checks the device (a CPU here)
    with pytest.raises(ValueError, match=r"CudaGraph captures one shape"):
        run(4, ProgressiveResizing(start=16, buckets=2), FitlibCudaGraph())
    shapes = Shapes()  # one size for the whole fit: one shape to capture
    run(2, ProgressiveResizing(sizes={0: 16}), CudaGraph(), shapes)
    assert shapes.train == {0: {(16, 16)}, 1: {(16, 16)}}


# -- compilation: one graph per size bucket ------------------------------------------
class TrainGraphs:
    """A torch.compile backend that runs graphs eagerly and notes the image
    size of each graph it is given: ``(None, None)`` for a graph of dynamic
    sizes (its inputs hold the sizes, as ints)."""

    def __init__(self):
        self.sizes = []

    def __call__(self, gm, example_inputs):
        if any(not isinstance(t, torch.Tensor) for t in example_inputs):
            self.sizes.append((None, None))
        else:
            batch = [t for t in example_inputs if t.dim() == 4 and t.shape[0] == 16]
            self.sizes.append(tuple(batch[0].shape[-2:]))
        return gm.forward


@pytest.fixture
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_training_compiles_once_per_bucket_not_per_epoch():
    graphs = TrainGraphs()
    grow = ProgressiveResizing(start=8, end=32, buckets=3, until=0.7)
    assert len(set(grow.schedule(6))) == 3
    run(6, grow, Compile(backend=graphs, dynamic=False))
    # A graph per size for training, and one more at (32, 32) for validation
    # (eval mode, a graph of its own)
    assert sorted(graphs.sizes) == [(8, 8), (16, 16), (32, 32), (32, 32)]


@pytest.mark.usefixtures("fresh_compiler")
def test_with_torchs_default_the_second_size_makes_the_shape_dynamic():
    graphs = TrainGraphs()
    run(6, ProgressiveResizing(start=8, end=32, buckets=3, until=0.7),
        Compile(backend=graphs))  # fmt: skip
    # (8, 8), then dynamic sizes: one graph for validation, one for training
    assert graphs.sizes == [(8, 8), (None, None), (None, None)]


@pytest.mark.usefixtures("fresh_compiler")
def test_a_size_per_epoch_would_compile_at_every_epoch():
    graphs = TrainGraphs()
    every = ProgressiveResizing(sizes={e: 8 + 4 * e for e in range(6)})
    run(6, every, Compile(backend=graphs, dynamic=False))
    assert len(graphs.sizes) == 6 + 1  # the control of the test above


# -- exact resume --------------------------------------------------------------------
def learner(*callbacks):
    torch.manual_seed(0)
    return Learner(image_data(), convnet(), F.cross_entropy, progress=False,
                   opt_func=torch.optim.SGD, callbacks=list(callbacks))  # fmt: skip


def test_a_run_crashed_mid_fit_resumes_to_the_unbroken_runs_weights(tmp_path):
    grow = {"start": 16, "buckets": 2, "until": 0.5}
    ref = learner(ProgressiveResizing(**grow))
    ref.fit(4, lr=0.1)
    crashed = learner(ProgressiveResizing(**grow), Checkpoint(tmp_path), Crash(9))
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(4, lr=0.1)  # epoch 2 of 4, at the full size already
    resumed = learner(ProgressiveResizing(**grow), Checkpoint(tmp_path))
    resumed.fit(4, lr=0.1)
    assert all(map(torch.equal, ref.model.state_dict().values(),
                   resumed.model.state_dict().values()))  # fmt: skip
    assert ref.recorder.losses == resumed.recorder.losses


def test_killed_with_sigkill_at_random_moments_the_run_ends_identical(tmp_path):
    killed_and_resumed_equal(tmp_path, "resize", seed=31)


# -- CUDA ----------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_batch_is_resized_on_the_device_as_on_the_cpu():
    seen = []
    keep = Callback.from_hooks(on_batch_begin=lambda last_input, train: seen.append(
        last_input) if train else None)  # fmt: skip
    data = DataBunch(DataLoader(images(16), 16), device="cuda")
    run(1, ProgressiveResizing(sizes={0: (12, 20)}), keep, data=data,
        model=convnet().cuda())  # fmt: skip
    assert seen[0].device.type == "cuda", f"resized on {seen[0].device}"
    want = F.interpolate(images(16).tensors[0], size=(12, 20), mode="bilinear",
                         antialias=True, align_corners=False)  # fmt: skip
    diff = (seen[0].cpu() - want).abs().max().item()
    assert diff < 1e-5, f"CUDA's resize differs from the CPU's by up to {diff:.3g}"
