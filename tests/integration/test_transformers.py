"""A model that computes its own loss: a small ``transformers`` model built
from a config (random weights, no download), trained with ``loss_func=None``
on dict batches whose ``labels`` sit among the inputs."""

import pytest
import torch
from helpers import Crash
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

from fitlib import DataBunch, Learner
from fitlib.callbacks import Checkpoint
from fitlib.metrics import accuracy

VOCAB, LENGTH = 20, 8


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def examples(n, seed):
    """Dicts as a tokenizer and collator give them; label: token 3 present."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, LENGTH), generator=g)
    ids[torch.rand(n, LENGTH, generator=g) < 0.1] = 3
    labels = (ids == 3).any(1).long()
    mask = torch.ones_like(ids)
    return [
        {"input_ids": i, "attention_mask": m, "labels": y}
        for i, m, y in zip(ids, mask, labels, strict=True)
    ]


def learner(callbacks=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    data = DataBunch(
        DataLoader(examples(64, 0), 16, shuffle=True, generator=g),
        DataLoader(examples(32, 1), 16),
        device="cpu",
    )
    return Learner(data, tiny_bert(seed), loss_func=None, metrics=[accuracy],
                   opt_func=torch.optim.AdamW, progress=False,
                   callbacks=list(callbacks))  # fmt: skip


def whole_set(learn):
    """Loss and accuracy of the validation set, computed by hand."""
    batch = {k: torch.stack([e[k] for e in examples(32, 1)]) for k in examples(1, 1)[0]}
    with torch.no_grad():
        out = learn.model.eval()(**batch)
    return out.loss.item(), (
        out.logits.argmax(1) == batch["labels"]
    ).double().mean().item()


def test_loss_func_none_trains_on_the_models_loss_and_metrics_read_logits():
    learn = learner()
    history = learn.fit(4, lr=3e-3)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    loss, acc = whole_set(learn)
    assert history[-1]["valid_loss"] == pytest.approx(loss, rel=1e-5)
    assert history[-1]["accuracy"] == pytest.approx(acc)
    preds, targets = learn.get_preds()
    assert preds.logits.shape == (32, 2) and targets.shape == (32,)


def test_a_fine_tuned_model_saves_loads_and_predicts_the_same(tmp_path):
    learn = learner()
    learn.path = tmp_path
    learn.fit(1, lr=3e-3)
    learn.save("bert")
    other = learner(seed=1)
    other.path = tmp_path
    other.load("bert")
    item = examples(1, 2)[0]
    a, b = learn.predict(item), other.predict(item)
    assert a.logits.shape == (2,) and torch.equal(a.logits, b.logits)


def test_a_resumed_fine_tuning_ends_bit_identical(tmp_path):
    ref = learner()
    ref.fit(3, lr=3e-3)
    for crash in (5, None):  # dropout and shuffling resume exactly
        extra = [Crash(crash)] if crash is not None else []
        learn = learner([Checkpoint(tmp_path, every_n_steps=2), *extra])
        try:
            learn.fit(3, lr=3e-3)
        except RuntimeError:
            assert crash is not None
    ref_state, state = ref.model.state_dict(), learn.model.state_dict()
    assert all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    assert learn.recorder.losses == ref.recorder.losses


def test_a_model_without_labels_in_the_batch_says_what_it_found():
    learn = learner()
    for dl in (learn.data.train_dl, learn.data.valid_dl):
        dl.dataset[:] = [{k: v for k, v in e.items() if k != "labels"}
                         for e in dl.dataset]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"loss_func=None.*returned {'logits': Tensor.*no loss.*'labels' key",
    ):
        learn.fit(1, lr=1e-3)
