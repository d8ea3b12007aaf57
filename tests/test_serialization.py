import os
import stat

import pytest
import torch

from fitlib.resume import remove_temporaries
from fitlib.serialization import atomic_save, safe_load


class Config:
    """A plain Python object: loading it would mean running its class's code."""

    lr = 0.1


def test_a_file_holding_python_objects_is_refused_without_advice_to_unpickle(
    tmp_path,
):
    path = tmp_path / "state.pth"
    torch.save({"weights": torch.ones(2), "config": Config()}, path)
    with pytest.raises(ValueError, match="Python objects other than tensors") as e:
        safe_load(path)
    message = str(e.value)
    assert "Config" in message and "refuses to unpickle" in message
    assert "torch.save(model.state_dict()" in message
    assert "weights_only" not in message and "truncated" not in message


@pytest.mark.parametrize("content", [b"not a torch file" * 4, b""])
def test_a_damaged_file_is_called_corrupt_without_advice_to_unpickle(tmp_path, content):
    path = tmp_path / "state.pth"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="truncated, corrupt") as e:
        safe_load(path)
    assert "weights_only" not in str(e.value)


def test_a_legacy_pickle_of_python_objects_is_refused_too(tmp_path):
    path = tmp_path / "state.pth"
    torch.save({"config": Config()}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match=r"Python objects .*Config"):
        safe_load(path)


def test_atomic_write_gives_a_text_file_the_mode_of_open(tmp_path):
    from fitlib.serialization import atomic_write

    old = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "a.csv", "w", newline="") as f:
            f.write("a,b\r\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.csv").read_bytes() == b"a,b\r\n"
    assert stat.S_IMODE((tmp_path / "a.csv").stat().st_mode) == 0o640


def test_a_killed_saves_temporary_file_is_one_the_next_run_removes(
    tmp_path, monkeypatch
):
    seen = []

    def killed(obj, f):
        seen.extend(p.name for p in tmp_path.iterdir())
        raise KeyboardInterrupt  # stands for the kill: the file stays half written

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"v": torch.ones(1)}, tmp_path / "checkpoint-000001.pth")
    assert len(seen) == 1 and seen[0].startswith(".checkpoint-000001.pth.")
    (tmp_path / seen[0]).write_bytes(b"half")  # as a SIGKILL would leave it
    remove_temporaries(tmp_path)
    assert list(tmp_path.iterdir()) == []
