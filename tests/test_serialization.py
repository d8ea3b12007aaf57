import errno
import os
import pickle
import re
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from fitlib.serialization import DamagedFileError, atomic_save, safe_load


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


# -- damaged files (issue 29, item 15) ---------------------------------------------
def member_holding(path, tensor):
    """The zip member of ``path`` that holds ``tensor``'s bytes, and the offset
    of those bytes in the file (from the member's local header)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if z.read(i) == tensor.numpy().tobytes())
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.filename, info.header_offset + 30 + name_len + extra_len


def flip_bit(path, offset, bit=0):
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 1 << bit
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("mmap", [False, True])
def test_a_flipped_bit_in_a_stored_weight_is_refused(tmp_path, mmap):
    weight = torch.randn(4, 5)
    path = atomic_save({"w": weight, "b": torch.zeros(3)}, tmp_path / "s.pth")
    member, offset = member_holding(path, weight)
    flip_bit(path, offset + 8)  # the lowest bit of weight[0, 2]: a 1-ulp change
    with pytest.raises(DamagedFileError, match="do not match their CRC-32") as e:
        safe_load(path, mmap=mmap)
    message = str(e.value)
    assert str(path) in message and repr(member) in message and "Fix:" in message
    assert isinstance(e.value, ValueError)


def test_a_flipped_bit_in_the_structure_is_refused(tmp_path):
    path = atomic_save({"lr": 0.125, "step": 12345}, tmp_path / "s.pth")
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    data = path.read_bytes()
    at = data.index(struct.pack("<d", 0.125)[::-1])  # pickle stores floats big-endian
    flip_bit(path, at + 7)  # 0.125 would load as a nearby float
    expected = f"member {re.escape(repr(info.filename))} .*do not match their CRC-32"
    with pytest.raises(DamagedFileError, match=expected):
        safe_load(path)


def test_an_intact_file_loads_with_every_value(tmp_path):
    state = {"w": torch.randn(3, 3), "n": 7, "rng": torch.get_rng_state()}
    loaded = safe_load(atomic_save(state, tmp_path / "s.pth"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 7
    assert torch.equal(loaded["rng"], state["rng"])


# -- a full disk (issue 29, item 18) -----------------------------------------------
class FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk(monkeypatch, room):
    opened = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FullDisk(opened(*a, **k), room))


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = atomic_save({"w": torch.ones(3)}, tmp_path / "s.pth")
    before = path.read_bytes()
    fill_disk(monkeypatch, room=1000)
    with pytest.raises(OSError, match="no space left on the device") as e:
        atomic_save({"w": torch.zeros(100_000)}, path)
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC and str(path) in message
    assert "400,000 bytes" in message  # what the tensors take
    assert "the file keeps what it held" in message and "Fix:" in message
    assert [p.name for p in tmp_path.iterdir()] == ["s.pth"]  # no temporary left
    assert path.read_bytes() == before


def test_torchs_unexpected_pos_error_is_said_as_a_full_disk(tmp_path, monkeypatch):
    def failed(obj, f):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        )

    monkeypatch.setattr(torch, "save", failed)
    with pytest.raises(OSError, match="no space left on the device") as e:
        atomic_save({"w": torch.ones(3)}, tmp_path / "s.pth")
    assert str(tmp_path / "s.pth") in str(e.value)
    assert "unexpected pos" in str(e.value)  # torch's own words kept
    assert list(tmp_path.iterdir()) == []


def test_a_text_file_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    from fitlib.serialization import atomic_write

    fill_disk(monkeypatch, room=10)
    with (
        pytest.raises(OSError, match="no space left on the device") as e,
        atomic_write(tmp_path / "a.csv", "w") as f,
    ):
        f.write("x" * 100_000)
    assert str(tmp_path / "a.csv") in str(e.value) and e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_an_error_that_is_not_a_write_passes_unchanged(tmp_path):
    with pytest.raises((AttributeError, pickle.PicklingError)):  # a local function
        atomic_save({"f": lambda: 1}, tmp_path / "s.pth")
    assert list(tmp_path.iterdir()) == []


# -- pre-planted links (issue 29, item 14) -----------------------------------------
@pytest.mark.parametrize("dangling", [False, True])
def test_a_temporary_files_name_planted_as_a_link_is_not_followed(
    tmp_path, monkeypatch, dangling
):
    from fitlib import serialization

    victim = tmp_path / "victim.txt"
    if not dangling:
        victim.write_text("keep me")
    planted = tmp_path / ".s.pth.aaaaaaaaaaaa.tmp"
    planted.symlink_to(victim)
    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(serialization.secrets, "token_hex", lambda n: next(names))
    atomic_save({"w": torch.ones(2)}, tmp_path / "s.pth")
    assert torch.equal(safe_load(tmp_path / "s.pth")["w"], torch.ones(2))
    assert planted.is_symlink()
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_text() == "keep me"


# -- files saved without checksums (torch.serialization.set_crc32_options) ---------
@pytest.fixture
def crc_off():
    """torch told to write no CRC-32s (CRC 0 for every member), as a user may."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


def test_atomic_save_writes_checksums_when_torch_is_told_not_to(tmp_path, crc_off):
    path = atomic_save({"w": torch.randn(5)}, tmp_path / "s.pth")
    with zipfile.ZipFile(path) as z:
        assert all(i.CRC != 0 for i in z.infolist() if i.file_size)
    assert torch.serialization.get_crc32_options() is False  # the user's, kept
    weight = safe_load(path)["w"]
    flip_bit(path, member_holding(path, weight)[1])
    with pytest.raises(DamagedFileError, match="CRC-32"):  # still verified
        safe_load(path)


def test_a_file_saved_without_checksums_loads_with_a_warning(tmp_path, crc_off):
    path = tmp_path / "s.pth"
    torch.save({"w": torch.arange(4.0)}, path)
    with pytest.warns(UserWarning, match="set_crc32_options") as warned:
        loaded = safe_load(path)
    assert str(path) in str(warned[0].message)
    assert "cannot be verified" in str(warned[0].message)
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_a_damaged_file_error_has_its_parts(tmp_path):
    weight = torch.randn(4, 5)
    path = atomic_save({"w": weight}, tmp_path / "s.pth")
    flip_bit(path, member_holding(path, weight)[1] + 8)
    with pytest.raises(DamagedFileError) as e:
        safe_load(path)
    error = e.value
    assert error.path == path and "CRC-32" in error.reason
    assert "Fix:" not in error.reason and "Fix:" not in error.fix
    assert str(error).count("Fix:") == 1 and str(error).endswith(f"Fix: {error.fix}.")


# -- SaveError: an OSError and a RuntimeError, said as it happened -----------------
class Failing(FullDisk):
    """A file whose first write fails with ``number``."""

    def __init__(self, f, number):
        super().__init__(f, 0)
        self.number = number

    def write(self, data):
        raise OSError(self.number, os.strerror(self.number))


@pytest.mark.parametrize("caught", [RuntimeError, OSError])
def test_a_failed_save_is_caught_as_runtime_error_and_os_error(
    tmp_path, monkeypatch, caught
):
    fill_disk(monkeypatch, room=10)
    with pytest.raises(caught, match="no space left"):  # torch's was RuntimeError
        atomic_save({"w": torch.zeros(1000)}, tmp_path / "s.pth")


def test_a_file_size_limit_is_said_as_such(tmp_path, monkeypatch):
    opened = os.fdopen
    monkeypatch.setattr(
        os, "fdopen", lambda *a, **k: Failing(opened(*a, **k), errno.EFBIG)
    )
    with pytest.raises(OSError, match="size limit") as e:
        atomic_save({"w": torch.zeros(1000)}, tmp_path / "s.pth")
    assert e.value.errno == errno.EFBIG and "permissions" not in str(e.value)
    assert "temporary file was removed" in str(e.value)


def test_a_temporary_file_never_created_is_not_said_removed(tmp_path, monkeypatch):
    from fitlib import serialization

    def no_inode(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serialization, "new_temporary", no_inode)
    with pytest.raises(OSError, match="no space left on the device") as e:
        atomic_save({"w": torch.zeros(10)}, tmp_path / "s.pth")
    assert "removed" not in str(e.value) and str(tmp_path / "s.pth") in str(e.value)


# -- one open file from check to load ----------------------------------------------
def test_a_file_swapped_after_its_check_is_not_loaded(tmp_path, monkeypatch):
    from fitlib import serialization

    path = atomic_save({"w": torch.ones(3)}, tmp_path / "s.pth")
    other = atomic_save({"w": torch.zeros(3)}, tmp_path / "other.pth")
    checked = serialization.verify_file

    def check_then_swap(*args, **kwargs):
        checked(*args, **kwargs)
        os.replace(other, path)  # another file takes the name once checked

    monkeypatch.setattr(serialization, "verify_file", check_then_swap)
    assert torch.equal(safe_load(path)["w"], torch.ones(3))  # the file checked
