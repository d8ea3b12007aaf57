"""A summary drawn (``fitlib.summary_text``): the text fitted to 100 columns
with aligned columns, the HTML table escaped, the words and numbers both
show. Summaries built by ``summarize`` on tiny models, or by hand."""

from __future__ import annotations

import torch
from torch import nn

from fitlib.summary import GroupInfo, LayerInfo, Summary, summarize
from fitlib.summary_text import WIDTH, as_html, as_text, shape_text


def one_batch(*xs):
    return [(tuple(xs),)]  # a loader of one batch of inputs only: model(*xs)


def test_a_partly_frozen_layer_says_partly():
    model = nn.Sequential(nn.Linear(2, 4))
    model[0].bias.requires_grad_(False)
    assert str(summarize(model)).splitlines()[3].split()[-1] == "partly"


class LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_very_long_encoder_name = nn.ModuleDict(
            {"with_a_long_block_name_too": nn.LSTM(8, 4000, batch_first=True)}
        )

    def forward(self, x):
        return self.a_very_long_encoder_name["with_a_long_block_name_too"](x)


def test_the_text_fits_100_columns_with_thousands_separators_and_aligned_columns():
    s = summarize(LongNames(), one_batch(torch.zeros(2, 3, 8)))
    lines = str(s).splitlines()
    layer_lines = lines[1:4]
    assert max(len(line) for line in lines) <= 100
    assert "64,160,000" in lines[3]  # 4 * 4000 * (8 + 4000 + 2)
    assert lines[3].startswith("…") and "with_a_long_block_name_too"[-10:] in lines[3]
    starts = {
        line.index(word) for line, word in zip(layer_lines, ["type", "---", "LSTM"])
    }
    assert len(starts) == 2  # the header's "type" and the row's "LSTM" start together
    assert s._repr_html_().count("with_a_long_block_name_too") == 1  # the full name


def test_the_html_is_a_table_with_escaped_text():
    class Odd(nn.Module):
        def forward(self, x):
            return {"<b>": x}

    html = summarize(nn.Sequential(Odd()), one_batch(torch.zeros(2))).\
        _repr_html_()  # fmt: skip
    assert "<table>" in html and "<th" in html
    assert "&lt;b&gt;" in html and "<b>:" not in html
    assert repr(summarize(Odd())) == str(summarize(Odd()))


def by_hand(**changes) -> Summary:
    """A summary of one 3M-parameter layer, built without a model."""
    layer = LayerInfo("enc", "Linear", torch.Size([2, 3]), 3_000_000, 0, 1)
    fields = dict(model="Net", layers=[layer], input_shape=None, output_shape=None,
                  total=3_000_000, trainable=0, size_bytes=12_000_000)  # fmt: skip
    return Summary(**{**fields, **changes})


def test_the_summary_draws_itself_with_these_functions():
    s = by_hand(callbacks=[(50, "Recorder & <co>")])
    assert str(s) == repr(s) == as_text(s)
    assert s._repr_html_() == as_html(s)
    assert "Recorder &amp; &lt;co&gt;" in as_html(s)


def test_sizes_in_bytes_kilobytes_megabytes_and_gigabytes():
    for size, text in [(780, "780 B"), (1_500, "1.5 KB"), (12_000_000, "12.0 MB"),
                       (4_200_000_000, "4.2 GB")]:  # fmt: skip
        assert as_text(by_hand(size_bytes=size)).splitlines()[4] == (
            f"Parameters: 3,000,000 total, 0 trainable, 3,000,000 frozen ({text})"
        )


def test_hyper_parameters_show_four_digits_and_tuples_in_parentheses():
    hypers = {"lr": 0.0012345, "betas": (0.9, 0.999), "amsgrad": 1}
    group = GroupInfo(0, "", 3_000_000, 0, "Adam", hypers)
    lines = as_text(by_hand(groups=[group], optimizer="Adam")).splitlines()
    at = lines.index("Optimizer: Adam")
    assert lines[at + 1].split() == ["group", "params", "trainable", "lr", "betas",
                                     "amsgrad"]  # fmt: skip
    assert lines[at + 3].split() == ["0", "3,000,000", "0", "0.001234", "(0.9,",
                                     "0.999)", "1"]  # fmt: skip


def test_a_line_longer_than_the_width_is_cut_with_an_ellipsis():
    note = "x" * 150
    lines = as_text(by_hand(notes=[note])).splitlines()
    (cut,) = [line for line in lines if line.startswith("Note:")]
    assert len(cut) == WIDTH == 100 and cut.endswith("x…")
    assert f"Note: {note}" in as_html(by_hand(notes=[note]))  # HTML is never cut


def test_shape_text_writes_sizes_tuples_dicts_and_unknown_shapes():
    shape = (torch.Size([16, 5, 32]), {"h": torch.Size([1, 16]), "n": "int"})
    assert shape_text(shape) == "([16, 5, 32], {h: [1, 16], n: int})"
    assert shape_text(None) == "?" and shape_text(torch.Size([])) == "[]"
