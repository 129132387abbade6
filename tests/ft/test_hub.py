"""Models by name without the network: the real `huggingface_hub` client against a loopback hub
(tests/ft/hub_server.py) holding a GGUF repo with several quants and a split, and an HF folder repo
(the tiny preset's own files, so the folder that comes back is one the engine loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ft import hub
from tests.ft.hub_server import COMMIT, Hub

ROOT = Path(__file__).resolve().parents[2]
GGUF_REPO = "acme/Tiny-GGUF"
HF_REPO = "acme/Tiny"


def blob(name: str, size: int) -> bytes:
    return (name.encode() * (size // len(name) + 1))[:size]


GGUF_FILES = {
    "README.md": b"# Tiny GGUF\n",
    "Tiny-Q4_K_M.gguf": blob("q4km", 300_000),
    "Tiny-Q8_0.gguf": blob("q80", 24 << 20),  # beyond the client's 10 MiB download chunk: a cut keeps one
    "Tiny-UD-Q4_K_XL.gguf": blob("ud", 310_000),
    "Q6_K/Tiny-Q6_K-00001-of-00002.gguf": blob("q6a", 200_000),
    "Q6_K/Tiny-Q6_K-00002-of-00002.gguf": blob("q6b", 190_000),
    "mmproj-F16.gguf": blob("mm", 1000),
}


@pytest.fixture(scope="module")
def preset_files() -> dict[str, bytes]:
    from engine.engine import ensure_preset

    folder = ensure_preset("tiny")
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def loopback_hub(preset_files):
    server = Hub({GGUF_REPO: dict(GGUF_FILES), HF_REPO: {**preset_files, "README.md": b"tiny\n"}})
    yield server
    server.close()


@pytest.fixture
def hub_env(loopback_hub, tmp_path) -> dict[str, str]:
    """An environment whose `huggingface_hub` talks to the loopback hub, with a private cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": loopback_hub.url, "HF_HOME": str(tmp_path / "hf")}


RESOLVE = """
import sys
from ft import hub
try:
    print(hub.resolve(sys.argv[1]))
except hub.HubError as exc:
    sys.exit(f"error: {exc}")
"""


def resolve(spec: str, env: dict[str, str]) -> Path:
    """`ft.hub.resolve` in a fresh process (the hub client reads HF_* when it is imported)."""
    done = subprocess.run([sys.executable, "-c", RESOLVE, spec], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    if done.returncode:
        raise hub.HubError(done.stderr.strip().splitlines()[-1].removeprefix("error: "))
    return Path(done.stdout.strip())


def test_a_quant_resolves_to_its_file_in_the_standard_cache(hub_env, tmp_path):
    path = resolve(f"{GGUF_REPO}:Q4_K_M", hub_env)
    assert path.name == "Tiny-Q4_K_M.gguf" and path.read_bytes() == GGUF_FILES["Tiny-Q4_K_M.gguf"]
    assert path.parent == tmp_path / "hf" / "hub" / "models--acme--Tiny-GGUF" / "snapshots" / COMMIT
    assert sorted(p.name for p in path.parent.rglob("*.gguf")) == ["Tiny-Q4_K_M.gguf"]  # nothing else fetched


def test_a_split_quant_brings_every_part_and_a_lower_case_name_matches(hub_env):
    path = resolve(f"{GGUF_REPO}:q6_k", hub_env)
    assert path.name == "Tiny-Q6_K-00001-of-00002.gguf"
    parts = sorted(path.parent.glob("*.gguf"))
    assert [p.name for p in parts] == ["Tiny-Q6_K-00001-of-00002.gguf", "Tiny-Q6_K-00002-of-00002.gguf"]
    assert parts[1].read_bytes() == GGUF_FILES["Q6_K/Tiny-Q6_K-00002-of-00002.gguf"]


def test_a_missing_quant_lists_the_quants_that_exist(hub_env):
    with pytest.raises(hub.HubError) as exc:
        resolve(f"{GGUF_REPO}:Q3_K_S", hub_env)
    message = str(exc.value)
    assert "no Q3_K_S file" in message
    for quant in ("Q4_K_M (0.0 GB)", "Q6_K", "Q8_0", "UD-Q4_K_XL"):
        assert quant in message
    assert "F16" not in message  # the projector is not a model quant


def test_a_missing_repo_names_the_owners_repos(hub_env):
    with pytest.raises(hub.HubError, match=r"acme/Tiny-GGUFF: no such repo; acme's models like it: .*acme/Tiny-GGUF"):
        resolve("acme/Tiny-GGUFF:Q4_K_M", hub_env)


def test_an_hf_folder_repo_resolves_to_a_folder_the_engine_loads(hub_env, preset_files):
    from engine.config import ModelConfig

    folder = resolve(HF_REPO, hub_env)
    assert folder.name == COMMIT and not (folder / "README.md").exists()
    assert {p.name for p in folder.iterdir()} == {Path(name).name for name in preset_files}
    assert ModelConfig.from_folder(folder).num_hidden_layers == 4
    with pytest.raises(hub.HubError, match="not a GGUF repo"):
        resolve(f"{HF_REPO}:Q4_K_M", hub_env)


def test_an_interrupted_download_resumes_where_it_stopped(loopback_hub, hub_env):
    name = "Tiny-Q8_0.gguf"
    loopback_hub.cut_once.add(name)
    path = resolve(f"{GGUF_REPO}:Q8_0", hub_env)
    assert path.read_bytes() == GGUF_FILES[name]
    gets = [r for r in loopback_hub.requests if r[0] == "GET" and r[1].endswith(name)]
    assert len(gets) == 2 and gets[0][2] is None
    resumed_at = int(gets[1][2].removeprefix("bytes=").rstrip("-"))  # the second asked only for the rest
    assert 0 < resumed_at <= len(GGUF_FILES[name]) // 2


def ft(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ft", *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def test_ft_pull_honours_hf_endpoint_and_offline_mode_uses_the_cache(loopback_hub, hub_env):
    env = hub_env
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    missing = ft("pull", f"{GGUF_REPO}:Q4_K_M", env=offline)
    assert missing.returncode == 1 and "not in the Hugging Face cache" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    pulled = ft("pull", f"{GGUF_REPO}:Q4_K_M", env=env)
    assert pulled.returncode == 0, pulled.stderr
    served = len(loopback_hub.requests)
    again = ft("pull", f"{GGUF_REPO}:Q4_K_M", env=offline)
    assert again.returncode == 0, again.stderr
    assert again.stdout == pulled.stdout and "Tiny-Q4_K_M.gguf" in again.stdout
    assert len(loopback_hub.requests) == served  # offline: not one request
    listed = ft("models", env=offline)
    assert f"{GGUF_REPO}:Q4_K_M" in listed.stdout and "Q8_0" not in listed.stdout
