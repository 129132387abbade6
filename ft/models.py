"""`ft models`: the models on this machine: those in the Hugging Face cache (GGUF repos by quant),
and the presets written under the ft home; each with its size on disk."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ft import env, hub


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def cached() -> list[tuple[str, str, int]]:
    """(name to pass as --model, where, bytes) of every model in the Hugging Face cache: one row a
    quant of a GGUF repo, one a snapshot of another repo."""
    from huggingface_hub import scan_cache_dir  # noqa: PLC0415

    try:
        info = scan_cache_dir()
    except Exception:  # noqa: BLE001 (no cache folder yet, or one the scan cannot read: nothing cached)
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        files = [hub.RepoFile(f.file_path.relative_to(rev.snapshot_path).as_posix(), f.size_on_disk)
                 for rev in repo.revisions for f in rev.files]
        by_quant = hub.quants(files)
        where = str(repo.repo_path)
        rows += [(f"{repo.repo_id}:{q}", where, sum(f.size for f in fs)) for q, fs in by_quant.items()]
        if not by_quant:
            rows.append((repo.repo_id, where, repo.size_on_disk))
    return rows


def presets() -> list[tuple[str, str, int]]:
    rows = []
    for folder in sorted((env.home() / "models").glob("*")):
        if (folder / "config.json").is_file():
            name = folder.name.rsplit("-r", 1)[0]
            rows.append((name, str(folder), sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())))
    return rows


def run(args: argparse.Namespace) -> int:
    table = Table("MODEL", "SIZE", "WHERE", box=None, pad_edge=False)
    rows = cached() + presets()
    for name, where, size in rows:
        table.add_row(name, f"{size / hub.GB:.2f} GB", str(Path(where)))
    console = Console()
    if rows:
        console.print(table)
    else:
        console.print("no models yet: `ft pull owner/name[:QUANT]` downloads one; presets are written on first use")
    return 0
