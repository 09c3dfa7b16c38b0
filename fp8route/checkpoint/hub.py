"""Checkpoints in the Hugging Face hub cache, read offline: a repository id -> its snapshot folder.

huggingface_hub (and transformers through it) keeps each downloaded model repository as

    <cache>/models--ORG--NAME/
        refs/main             the commit `main` pointed to when it was downloaded
        snapshots/<commit>/   the repository's files, as relative symlinks into ../../blobs/
        blobs/<hash>          the files' contents

where <cache> is $HF_HUB_CACHE (or the older $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. fp8route reads that layout itself
(it does not depend on huggingface_hub) and never downloads anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fp8route.errors import CheckpointError

# org/name[@revision]; no part of a revision starts with a dot, so none can be "..".
_REPO_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w-][\w.-]*(?:/[\w-][\w.-]*)*))?$"
)
_PREFIX = "models--"


def hub_cache() -> Path:
    """The hub cache folder, found the way huggingface_hub finds it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache.expanduser() / "huggingface" / "hub"


def resolve_model_path(path_or_repo_id: str | os.PathLike[str]) -> Path:
    """The local folder of a model: path_or_repo_id itself when it names an existing folder (a
    local folder always wins), else, for a str that reads as a Hugging Face repository id
    ("org/name", or "org/name@revision" with a branch, tag or commit hash), that repository's
    snapshot folder in the local hub cache (hub_cache()): refs/<revision or main> -> snapshots/<commit>,
    or the only snapshot when there is no ref. Anything else comes back as a Path, for the caller
    to report as the folder it could not find. Never downloads.

    Raises CheckpointError, one line naming the cache folder searched and the command that
    downloads it, for a repository id that is not cached (or whose revision is not).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.exists() or not isinstance(path_or_repo_id, str):
        return path
    match = _REPO_ID.match(path_or_repo_id)
    if match is None:
        return path
    repo, revision = match.group("repo"), match.group("revision")
    cache = hub_cache()
    root = cache / (_PREFIX + repo.replace("/", "--"))
    args = repo + (f" --revision {revision}" if revision else "")
    download = f"`hf download {args}` (or `huggingface-cli download {args}`)"
    folders = root / "snapshots"
    snapshots = sorted(p.name for p in folders.iterdir() if p.is_dir()) if folders.is_dir() else []
    if not snapshots:
        raise CheckpointError(
            f"{path_or_repo_id} is neither a local folder nor in the Hugging Face hub cache (no snapshot in {root}): "
            f"download it with {download}, point HF_HUB_CACHE at the cache "
            "that holds it, or give the checkpoint folder's path"
        )
    commit = _commit(root, revision or "main")
    if commit is None:
        if revision is None and len(snapshots) == 1:
            return root / "snapshots" / snapshots[0]
        raise CheckpointError(
            f"{path_or_repo_id}: {root} has no refs/{revision or 'main'}"
            + (f" and no snapshot {revision}" if revision else f" and {len(snapshots)} snapshots")
            + f" (snapshots: {', '.join(snapshots)}): give {repo}@<commit>, or download it with {download}"
        )
    snapshot = root / "snapshots" / commit
    if not snapshot.is_dir():
        raise CheckpointError(
            f"{path_or_repo_id}: refs/{revision or 'main'} in {root} names commit {commit}, whose snapshot folder "
            f"is missing: download it again with {download}"
        )
    return snapshot


def repository_of(folder: Path) -> Path | None:
    """The hub-cache repository (models--ORG--NAME) that a snapshot folder belongs to, else None."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(_PREFIX):
        return real.parent.parent
    return None


def _commit(root: Path, revision: str) -> str | None:
    """The commit a ref (branch or tag) names, or the revision itself when it is a snapshot's commit."""
    ref = root / "refs" / revision
    if ref.is_file():
        return ref.read_text().strip()
    return revision if (root / "snapshots" / revision).is_dir() else None
