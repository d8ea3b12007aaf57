"""The recipes of the documentation site do what their pages say, beyond running
(tests/integration/test_docs_code.py runs every block): the WGAN-GP and SAM
callbacks equal hand-written loops bit for bit, and the loop driven by hand
trains. Each recipe is found by what it defines, on whichever page holds it.
"""

import ast
import re
import textwrap
from pathlib import Path

import torch
from helpers import make_dataset
from test_gan import gan, hand_written, loader, optimizers
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

from fitlib import CallbackHandler, DataBunch, GANLoss, fit
from fitlib.callbacks import GANTrainer

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A fence may be indented (a block inside a list item): its lines are too.
PYTHON_BLOCK = re.compile(r"^([ \t]*)```python[^\n]*\n(.*?)^\1```", re.S | re.M)


def page_blocks(page: Path) -> list[str]:
    """A page's ```python blocks that run (not those written to a file)."""
    blocks = [textwrap.dedent(b) for _, b in PYTHON_BLOCK.findall(page.read_text())]
    return [b for b in blocks if not b.lstrip().startswith("# file:")]


def holding(marker: str) -> tuple[Path, int]:
    """The page, and the index of its block, that holds ``marker``: exactly
    one block of the whole site."""
    found = [
        (page, i)
        for page in sorted(DOCS.rglob("*.md"))
        for i, block in enumerate(page_blocks(page))
        if marker in block
    ]
    assert len(found) == 1, f"{marker!r} is in {len(found)} blocks of docs/: {found}"
    return found[0]


def recipe_class(name: str) -> type:
    """The class ``name`` as its docs block defines it, with that block's
    imports (the rest of the block, a usage, is left out)."""
    page, i = holding(f"class {name}(Callback)")
    tree = ast.parse(page_blocks(page)[i])
    keep = [
        node
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        or (isinstance(node, ast.ClassDef) and node.name == name)
    ]
    code = "import torch\nfrom fitlib import Callback\n" + ast.unparse(keep)
    namespace = {}
    exec(compile(code, str(page), "exec"), namespace)
    return namespace[name]


def test_the_wgan_gp_recipe_equals_a_hand_written_wgan_gp_loop():
    penalty = recipe_class("GradientPenalty")(weight=10.0)
    model = gan()
    torch.manual_seed(1)
    fit(2, model, GANLoss("wgan"), optimizers(model), DataBunch(loader()),
        callbacks=[GANTrainer(n_critic=2), penalty])  # fmt: skip

    def gradient_penalty(c, real, fake):
        eps = torch.rand(len(real), 1)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(c(x_hat).sum(), x_hat, create_graph=True)
        return 10.0 * ((grad.norm(dim=1) - 1) ** 2).mean()

    ref = hand_written("wgan", n_critic=2, penalty=gradient_penalty)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_sam_recipe_equals_a_hand_written_sam_loop():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    dl = DataLoader(make_dataset(64), 16)
    sam = recipe_class("SAM")(rho=0.05)
    m = model()
    fit(2, m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
        DataBunch(dl), callbacks=[sam])  # fmt: skip

    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in dl:
            F.cross_entropy(ref(x), y).backward()
            params = list(ref.parameters())
            with torch.no_grad():
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
                )
                climbs = [p.grad * (0.05 / (norm + 1e-12)) for p in params]
                for p, e in zip(params, climbs):
                    p.add_(e)
                    p.grad = None
            F.cross_entropy(ref(x), y).backward()
            with torch.no_grad():
                for p, e in zip(params, climbs):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
    plain = model()
    fit(2, plain, F.cross_entropy, torch.optim.SGD(plain.parameters(), lr=0.1),
        DataBunch(dl))  # fmt: skip
    for p, q, r in zip(m.parameters(), ref.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert not torch.equal(p, r)  # SAM's step is not the plain one


def test_the_hand_driven_loop_runs_as_written_and_trains(tmp_path, monkeypatch):
    # The page's blocks up to the loop's, in one namespace, as the docs run them.
    page, last = holding("handler.on_train_begin(")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for block in page_blocks(page)[: last + 1]:
        exec(compile(block, str(page), "exec"), namespace)
    handler = namespace["handler"]
    assert isinstance(handler, CallbackHandler)
    assert [r["epoch"] for r in handler.history] == [0, 1, 2]
    n_batches = len(namespace["data"].train_dl)  # GradientAccumulation(2):
    assert handler.state["step"] == 3 * -(-n_batches // 2)  # steps in pairs
    losses = [r["valid_loss"] for r in handler.history]
    assert losses[-1] < losses[0]
