"""Models by name: a Hugging Face repo id (`owner/name`), with `:QUANT` for a GGUF repo, resolved
to local files in the standard Hugging Face cache.

`unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M` picks the repo's Q4_K_M file, or every part of its Q4_K_M
split (`…-00001-of-00003.gguf`, in the root or in a `Q4_K_M/` folder); `Qwen/Qwen3.6-35B-A3B`
(an HF folder repo) its config, tokenizer and safetensors. Downloads go through `huggingface_hub`:
resumable, with progress bars, honouring `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` (then the
files come from the cache, or the error says they are not there). A missing repo or quant is a
`HubError` listing what exists. This module imports nothing of the project, so `ft serve` (the
gateway) and `ft launch` may both use it.
"""

from __future__ import annotations

import importlib
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile as HubFile

# the HTTP client whose errors huggingface_hub lets through: httpx2 from its 2.0, httpx before
http = importlib.import_module("httpx2" if int(huggingface_hub.__version__.split(".")[0]) >= 2 else "httpx")

REPO_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<quant>[\w.-]+))?$")
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
# the quant label at the end of a GGUF file's stem: Q4_K_M, IQ4_XS, UD-Q4_K_XL, Q8_0, BF16, MXFP4_MOE ...
QUANT = re.compile(r"(?:^|[-_.])((?:UD-)?(?:I?Q\d\w*|BF16|F16|F32|MXFP4\w*))$", re.IGNORECASE)
HF_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")  # what an HF folder model loads
DEFAULT_QUANT = "Q4_K_M"  # a GGUF repo named without :QUANT (as llama.cpp's -hf does)
GB = 1e9


class HubError(ValueError):
    """A model name that cannot be resolved: the message says what exists instead."""


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int


def is_repo_id(spec: str) -> bool:
    return REPO_ID.match(spec) is not None


def parse(spec: str) -> tuple[str, str | None]:
    """(repo id, quant or None) of `owner/name[:QUANT]`."""
    match = REPO_ID.match(spec)
    if match is None:
        raise HubError(f"{spec!r} is not a Hugging Face repo id (owner/name, or owner/name:QUANT for a GGUF repo)")
    return match["repo"], match["quant"]


def quant_of(path: str) -> str | None:
    """The quant label of a GGUF model file (its split suffix ignored), None for other files and
    for projector files (mmproj)."""
    name = path.rsplit("/", 1)[-1]
    if not name.endswith(".gguf") or "mmproj" in name.lower():
        return None
    match = QUANT.search(SPLIT.sub("", name.removesuffix(".gguf")))
    return match[1].upper() if match else None


def quants(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """A GGUF repo's model files by quant label."""
    out: dict[str, list[RepoFile]] = defaultdict(list)
    for f in files:
        if (label := quant_of(f.path)) is not None:
            out[label].append(f)
    return dict(sorted(out.items()))


def describe(by_quant: dict[str, list[RepoFile]]) -> str:
    return ", ".join(f"{q} ({sum(f.size for f in fs) / GB:.1f} GB)" for q, fs in by_quant.items())


def select(repo: str, files: list[RepoFile], quant: str | None) -> list[str]:
    """The repo files a model needs: the quant's file or split parts in a GGUF repo, the config,
    tokenizer and weights of an HF folder repo."""
    by_quant = quants(files)
    if not by_quant:
        if quant is not None:
            raise HubError(f"{repo} is not a GGUF repo (no .gguf files): name it without :{quant}")
        if not any(f.path == "config.json" for f in files):
            raise HubError(f"{repo} has neither .gguf files nor a config.json: not a model ft can load")
        return [f.path for f in files if any(Path(f.path).match(p) for p in HF_FILES) and "/" not in f.path]
    if quant is None:
        if DEFAULT_QUANT not in by_quant and len(by_quant) > 1:
            raise HubError(f"{repo} holds several quants; name one as {repo}:QUANT: {describe(by_quant)}")
        quant = DEFAULT_QUANT if DEFAULT_QUANT in by_quant else next(iter(by_quant))
    chosen = by_quant.get(quant.upper())
    if chosen is None:
        raise HubError(f"{repo} has no {quant} file; its quants: {describe(by_quant)}")
    first = min(chosen, key=lambda f: f.path)  # one model: the parts of the first file's split
    stem = SPLIT.sub("", first.path.removesuffix(".gguf"))
    return sorted(f.path for f in chosen if SPLIT.sub("", f.path.removesuffix(".gguf")) == stem)


def listing(repo: str) -> list[RepoFile]:
    """The repo's files from the hub; offline (or with the hub unreachable), the files of its
    cached snapshot."""
    try:
        entries = HfApi().list_repo_tree(repo, recursive=True)
        return [RepoFile(e.path, e.size) for e in entries if isinstance(e, HubFile)]
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HubError(not_found(repo, exc)) from None
    except RevisionNotFoundError as exc:
        raise HubError(f"{repo}: {exc}") from None
    except (OfflineModeIsEnabled, http.ConnectError, http.TimeoutException, HfHubHTTPError):
        return cached_listing(repo)


def snapshot_folder(repo: str) -> Path | None:
    """The cached snapshot of the repo's main branch (the standard cache layout), or None."""
    storage = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    ref = storage / "refs" / "main"
    if not ref.is_file():
        return None
    folder = storage / "snapshots" / ref.read_text().strip()
    return folder if folder.is_dir() else None


def cached_listing(repo: str) -> list[RepoFile]:
    folder = snapshot_folder(repo)
    if folder is None:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else " and the hub cannot be reached"
        raise HubError(f"{repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}){offline}")
    files = [p for p in folder.rglob("*") if p.is_file()]
    return [RepoFile(p.relative_to(folder).as_posix(), p.stat().st_size) for p in files]


def not_found(repo: str, exc: Exception) -> str:
    """The message for a repo the hub does not show: the owner's models that exist, when it lists them."""
    gated = isinstance(exc, GatedRepoError)
    message = f"{repo}: {'gated: accept its terms on the hub and set HF_TOKEN' if gated else 'no such repo'}"
    if gated:
        return message
    owner, name = repo.split("/", 1)
    try:
        found = [m.id for m in HfApi().list_models(author=owner, search=name.split("-")[0], limit=20)]
    except (HfHubHTTPError, http.HTTPError, OfflineModeIsEnabled):
        found = []
    hint = f"; {owner}'s models like it: {', '.join(found)}" if found else " (a private repo needs HF_TOKEN)"
    return message + hint


def model_files(path: Path) -> list[Path]:
    """The files of a resolved model: a GGUF file with the other parts of its split, or a folder's files."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    stem = SPLIT.sub("", path.name.removesuffix(".gguf"))
    return sorted(p for p in path.parent.glob(f"{stem}*.gguf") if SPLIT.sub("", p.name.removesuffix(".gguf")) == stem)


def resolve(spec: str) -> Path:
    """The local path of model `spec` (`owner/name[:QUANT]`), downloaded into the cache if needed:
    a GGUF model's first file (its other parts beside it), or an HF model's snapshot folder."""
    repo, quant = parse(spec)
    wanted = select(repo, listing(repo), quant)
    try:
        folder = Path(snapshot_download(repo, allow_patterns=wanted))
    except (LocalEntryNotFoundError, EntryNotFoundError) as exc:
        raise HubError(f"{spec}: {exc}") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HubError(not_found(repo, exc)) from None
    return folder / wanted[0] if wanted[0].endswith(".gguf") else folder
