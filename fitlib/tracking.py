"""Helpers the loggers share (TextLogger, TrainStats, MLflowLogger).

``TrainClock`` (wall-clock seconds of training, validation left out), and
argument and state checks, among them what ``MLflowLogger`` checks before
training (its names, its store) and what it tags a run with to find the
run a killed process left (a checkpoint directory's id, the process's
host and pid). Not a callback.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from fitlib.checks import check_int, check_path
from fitlib.errors import ArgTypeError

# RunningLoss and step_lr live with the epoch record; imported from here too.
from fitlib.host_copy import to_floats
from fitlib.serialization import new_temporary, optimizer_identity


class TrainClock:
    """Wall-clock seconds spent training, validation and epoch ends left out.

    It runs from ``resume`` (an epoch's start) to ``pause`` (its first
    validation batch, or its end). On a GPU the host runs ahead of the device:
    read it right after a host-device sync, so the device's work is counted.

    Examples:
        >>> from fitlib.tracking import TrainClock
        >>> clock = TrainClock()
        >>> clock.pause(); seconds = clock.lap()
        >>> seconds < 1.0
        True
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self, seconds: float = 0.0) -> None:
        """Starts again from ``seconds`` (restored), running."""
        self._seconds, self._since = float(seconds), time.perf_counter()

    def pause(self) -> None:
        """Stops counting (validation begins); a paused clock stays paused."""
        if self._since is not None:
            self._seconds += time.perf_counter() - self._since
            self._since = None

    def resume(self) -> None:
        """Counts again (an epoch begins); a running clock keeps running."""
        if self._since is None:
            self._since = time.perf_counter()

    def elapsed(self) -> float:
        """Training seconds since the last ``lap`` (or ``reset``)."""
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self._seconds + running

    def lap(self) -> float:
        """``elapsed()``, and starts counting the next lap from zero."""
        seconds = self.elapsed()
        self._seconds = 0.0
        if self._since is not None:
            self._since = time.perf_counter()
        return seconds


def last_lr(opt: Any) -> Any:
    """The lr of the last group's latest step (as it is now, before any step)."""
    stepped = getattr(opt, "stepped", None)  # HPOptimizer notes it in step()
    return stepped[0] if stepped else opt.param_groups[-1]["lr"]


def read_into(interval: list, unread: list) -> None:
    """Adds ``unread`` (a list of (device loss, batch size), emptied) to
    ``interval`` ([weighted loss sum, samples]), read in one host transfer:
    the loggers' per-step points."""
    batches = unread[:]
    unread.clear()
    values = to_floats([loss for loss, _ in batches])
    for value, (_, size) in zip(values, batches, strict=True):
        interval[0] += value * size
        interval[1] += size


def check_every_n_steps(value: Any, owner: str, allow_none: bool = False) -> Any:
    """``value`` if it is an int >= 1 (or None when allowed), else a ValueError."""
    return check_int(
        value, "every_n_steps", minimum=1, owner=owner, example=100,
        allow_none=allow_none,
    )  # fmt: skip


def check_state_keys(state: Any, expected: tuple[str, ...], owner: str) -> None:
    """A ValueError unless ``state`` is a dict with exactly the keys ``expected``."""
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{owner}.load_state_dict: expected the dict {owner}.state_dict() "
            f"returns (keys {sorted(expected)}); got {got}. Fix: pass what "
            f"{owner}.state_dict() returned."
        )


def optimizer_params(opt: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The optimizer's class and its hyper-parameters ``names`` (the last
    group's), for a tracker's parameters; a ``MultiOptimizer``'s per part
    (``decoder.mom``), with every part's class in ``optimizer``."""
    values: dict[str, Any] = {"optimizer": optimizer_identity(opt)["opt_class"]}
    parts = getattr(opt, "parts", None) or {"": opt}
    for part, one in parts.items():
        for name in names:
            if hasattr(one, "has") and one.has(name):
                values[f"{part}.{name}" if part else name] = one.get(name)[-1]
    return values


# -- MLflowLogger's checks ---------------------------------------------------------
_MAX_TAG = 8000  # MLflow's longest tag value


def mlflow_uri(uri: Any) -> str:
    """``uri`` as MLflow takes it: a URI as it is, a folder (a str without
    a scheme, or a path) as a ``file://`` URI; a ``host:port`` without a
    scheme, an empty string or another type refused with the fix."""
    if isinstance(uri, str) and re.fullmatch(r"[\w.-]+:\d+/?", uri):
        raise ValueError(
            f"MLflowLogger: tracking_uri={uri!r} has no scheme. Fix: "
            f"'http://{uri}' for a server, or 'sqlite:///mlflow.db' for a file."
        )
    if isinstance(uri, str) and ("://" in uri or uri == "databricks"):
        return uri
    path = check_path(
        uri, "tracking_uri", owner="MLflowLogger", what="a store's URI or a folder",
        example="'sqlite:///mlflow.db'",
    )  # fmt: skip
    return path.resolve().as_uri()  # a folder: MLflow's file store


def check_mlflow_server(uri: str) -> None:
    """Asks the server's /health, briefly: MLflow's client would retry for
    minutes before failing."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
            r.read()
    except urllib.error.HTTPError:
        return  # it answered (a proxy without /health, a login page...)
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(
            f"MLflowLogger: no MLflow server answers at {uri!r} ({e}). Fix: start "
            "it (mlflow server --host 127.0.0.1 --port 5000) or pass another "
            "tracking_uri, e.g. 'sqlite:///mlflow.db' for a local file."
        ) from e


def check_mlflow_store(uri: str) -> None:
    """Refuses a local store MLflow cannot use, naming why: a folder or
    another file as a database, a path through a file."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:///:memory:"):
        path = Path(urllib.parse.unquote(uri[len("sqlite:///") :].split("?")[0]))
        kind = "database file"
    elif uri.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(uri).path))
        kind = "folder"
    else:
        return
    problem = _store_problem(path, kind)
    if problem:
        # A new file in the nearest folder there is (the path's own if it is one).
        folder = next(p for p in (path, *path.absolute().parents) if p.is_dir())
        fix = folder / ("runs.db" if folder / "mlflow.db" == path else "mlflow.db")
        raise ValueError(
            f"MLflowLogger: tracking_uri={uri!r}: {str(path)!r} {problem}. Fix: "
            f"name a new {kind} or an MLflow one"
            f"{'' if kind == 'database file' else ', or a database file'}, e.g. "
            f"tracking_uri='sqlite:///{fix}'."
        )


def mlflow_store_failure(uri: str, error: Exception) -> str:
    """The message for a store MLflow failed to open with ``error``."""
    said = " ".join(f"{type(error).__name__}: {error}".split())
    if "Unsupported" in type(error).__name__:  # MLflow words it as the registry
        schemes = re.search(r"Supported URI schemes are: (\[[^\]]*\])", str(error))
        said = f"it has no tracking store for the scheme {uri.split(':')[0]!r}"
        said += f"; it takes {schemes[1]}" if schemes else ""
    said = said if len(said) <= 600 else said[:597] + "..."
    return (
        f"MLflowLogger: tracking_uri={uri!r}: MLflow cannot open it as a "
        f"tracking store ({said}). Fix: pass a store that works: "
        "'sqlite:///mlflow.db' (a local file), 'http://127.0.0.1:5000' (a "
        "running mlflow server) or a database URI such as "
        "'postgresql://user@host/db' (with its driver installed)."
    )


def _store_problem(path: Path, kind: str) -> str | None:
    if path.exists():
        if path.is_dir() != (kind == "folder"):
            return f"is a {'file' if kind == 'folder' else 'folder'}, not a {kind}"
        if not os.access(path, os.R_OK | os.W_OK):
            return "cannot be read and written (permissions)"
        if kind == "folder":
            return None
        with open(path, "rb") as f:
            head = f.read(16)
        if head and head != b"SQLite format 3\x00":
            return "is not an SQLite database (MLflow would fail on it)"
        return None
    above = next(p for p in path.absolute().parents if p.exists())
    if not above.is_dir():
        return f"cannot be created: {str(above)!r} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"cannot be created: {str(above)!r} is not writable"
    return None


def check_mlflow_name(value: Any, name: str, example: str, none: bool = False) -> Any:
    """``value`` if it is a str that is not blank (or None when ``none``)."""
    if value is None and none:
        return None
    if not isinstance(value, str):
        raise ArgTypeError(
            f"MLflowLogger: {name} must be a str{' or None' if none else ''}; got "
            f"{value!r} ({type(value).__name__}). Fix: e.g. "
            f"MLflowLogger({name}={example})."
        )
    if not value.strip():
        raise ValueError(
            f"MLflowLogger: {name} must be a name, not empty or blank; got "
            f"{value!r} (str). Fix: e.g. MLflowLogger({name}={example})."
        )
    return value


def check_mlflow_names(values: Any, name: str) -> dict:
    """``values`` as a dict whose names MLflow takes (checked now: MLflow
    would refuse them as the run starts)."""
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ArgTypeError(
            f"MLflowLogger: {name} must be a dict of str names; got {values!r}. "
            f"Fix: e.g. {name}={{'dropout': 0.3}}."
        )
    for key in values:
        why = _bad_mlflow_name(key)
        if why:
            raise ValueError(
                f"MLflowLogger: {name}: the name {key!r} is not one MLflow takes "
                f"({why}). Fix: use letters, digits, spaces and _ - . / :, e.g. "
                f"{name}={{'dropout': 0.3}}."
            )
    return dict(values)


def _bad_mlflow_name(key: str) -> str | None:
    """Why MLflow would refuse ``key`` as a param or tag name (None: it takes
    it), by MLflow's own rules."""
    if not key.strip():
        return "it is empty or blank"
    if len(key) > 250:
        return f"{len(key)} characters; MLflow takes 250"
    refused = sorted({c for c in key if not re.fullmatch(r"[/\w.\- :]", c)})
    if refused:
        return f"MLflow refuses the characters {''.join(refused)!r}"
    norm = posixpath.normpath(key)
    if norm != key or norm.startswith(("..", "/")):
        return f"as a path it would be {norm!r}"
    return None


def check_mlflow_tags(tags: dict, reserved: tuple[str, ...]) -> dict:
    """``tags`` (checked by ``check_mlflow_names``) if none is ``reserved``
    (a tag fitlib sets) and every value fits MLflow, else a ValueError."""
    own = sorted(set(tags) & set(reserved))
    if own:
        raise ValueError(
            f"MLflowLogger: tags {own} are tags fitlib sets itself. Fix: give "
            "yours other names, e.g. tags={'team': 'vision'}."
        )
    for key, value in tags.items():
        if len(str(value)) > _MAX_TAG:
            raise ValueError(
                f"MLflowLogger: tags: the value of {key!r} is {len(str(value))} "
                f"characters; MLflow takes at most {_MAX_TAG}. Fix: shorten it, "
                "or pass it in params (a long value is shortened, with a note)."
            )
    return tags


# -- MLflowLogger's key to an experiment run ---------------------------------------
RUN_ID_FILE = ".fitlib.run_id"  # in a Checkpoint's directory


def directory_id(dirpath: Path) -> str:
    """The random id of the checkpoint directory ``dirpath``, made once (in
    ``dirpath/.fitlib.run_id``) and read after: the directory itself, not
    its path, names the experiment run. Call it holding the directory's
    lock; without one (Windows) two first runs may each make one, and the
    first written wins for both from then on."""
    path = Path(dirpath) / RUN_ID_FILE
    if not os.path.lexists(path):
        _create_id(path)
    return _read_id(path)


def _create_id(path: Path) -> None:
    """Writes a new id to ``path`` atomically, never over an existing one."""
    tmp, fd = new_temporary(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if a file is there: no overwrite
        except FileExistsError:
            pass  # made meanwhile: that one is the id
        except OSError:  # a file system without hard links
            if not os.path.lexists(path):
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_id(path: Path) -> str:
    problem = None
    if path.is_symlink() or not path.is_file():
        kind = "a directory" if path.is_dir() else "not a plain file"
        problem = f"is {'a symbolic link' if path.is_symlink() else kind}"
    else:
        text = path.read_text(errors="replace")
        if not re.fullmatch(r"[0-9a-f]{32}\n?", text):
            shown = text if len(text) <= 60 else text[:57] + "..."
            problem = f"holds {shown!r}, not an id fitlib wrote"
    if problem is None:
        return text.strip()
    raise ValueError(
        f"MLflowLogger: {str(path)!r} (the checkpoint directory's id, which "
        f"names its experiment run in MLflow) {problem}. Fix: delete it (the "
        "next fit makes a new one; runs that this directory's killed fits "
        "left RUNNING are then no longer closed by a rerun)."
    )


def process_gone(pid: Any) -> bool:
    """Whether the process ``pid`` of this machine has surely ended (False
    when it may be alive: it exists, it is another user's, the pid is not a
    number, or the platform cannot tell without harm)."""
    if os.name == "nt" or not str(pid).isdigit() or int(pid) <= 0:
        return False  # (Windows' os.kill would end the process)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        return False
    return False


def process_place() -> dict[str, str]:
    """Where this process runs, as tags: the host, the pid, and (Linux) the
    pid namespace (containers on one host name number processes apart)."""
    place = {"fitlib.host": socket.gethostname(), "fitlib.pid": str(os.getpid())}
    with contextlib.suppress(OSError):  # (not Linux)
        place["fitlib.pid_namespace"] = os.readlink("/proc/self/ns/pid")
    return place
