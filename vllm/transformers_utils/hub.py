"""Model and tokenizer arguments -> local directories: a directory as given, or a Hugging
Face Hub id (``ORG/NAME``) found in, or fetched into, the Hugging Face cache.

    resolve_model("mistralai/Mamba-Codestral-7B-v0.1")     # .../snapshots/<commit>
    resolve_model("path/to/model")                          # that directory
    resolve_tokenizer("org/name", revision="v2")

A hub id goes through ``huggingface_hub.snapshot_download`` (the cache layout, tokens,
``HF_ENDPOINT`` and ``HF_HUB_CACHE`` are huggingface_hub's), limited to what the engine
reads: config.json, generation_config.json, the tokenizer files, and the safetensors weights
(the shards ``model.safetensors.index.json`` names when the repo has one, which leaves out
a second copy such as Mistral's consolidated.safetensors; else every ``*.safetensors``).
``load_format="dummy"`` and tokenizers fetch no weights; ``.bin`` files never come, since
the loader reads safetensors only. With ``HF_HUB_OFFLINE`` set nothing is downloaded: the
snapshot of ``revision`` (``refs/<branch or tag>``, or a commit hash) must be in the cache.

Every failure is one line that names the id (and the revision and the cache where they
matter) and says what to do: FileNotFoundError when files are missing, ValueError for an
argument that cannot work, PermissionError for a gated repo, OSError for the Hub's other
answers.
A string that is an existing directory always wins over a hub id of the same spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.model_loader.weight_utils import SAFETENSORS_INDEX, read_safetensors_index

logger = init_logger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# huggingface_hub's rules for a namespaced repo id: letters, digits, "-", "_", "." in two
# parts of at most 96 characters in all, no "--" or "..".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", re.ASCII)


def is_hub_id(name) -> bool:
    """Whether ``name`` has the form of a Hub model id (``ORG/NAME``)."""
    return (
        isinstance(name, str)
        and len(name) <= 96
        and _HUB_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
    )


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """The cache a hub id is looked up in: ``download_dir``, else huggingface_hub's."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model(
    model: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    load_format: str = "auto",
) -> Path:
    """The local directory of ``model`` (a directory, or a hub id fetched with the config,
    tokenizer and, unless ``load_format`` is "dummy", safetensors files)."""
    local = _local_dir(model, "model", revision, "revision")
    if local is not None:
        return local
    hub = _Hub(model, revision, download_dir, "model")
    path = hub.snapshot([*CONFIG_FILES, *TOKENIZER_FILES, SAFETENSORS_INDEX])
    if load_format != "dummy":
        hub.fetch_weights(path)
    logger.info("model %s (revision %s): %s", model, hub.revision, path)
    return path


def resolve_tokenizer(
    tokenizer: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
) -> Path:
    """The local directory of ``tokenizer`` (a directory, or a hub id fetched with its
    tokenizer files and config.json only)."""
    local = _local_dir(tokenizer, "tokenizer", revision, "tokenizer_revision")
    if local is not None:
        return local
    hub = _Hub(tokenizer, revision, download_dir, "tokenizer")
    path = hub.snapshot([*CONFIG_FILES, *TOKENIZER_FILES])
    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer {tokenizer!r} (revision {hub.revision!r}, in {path}) has no tokenizer "
            f"files ({', '.join(TOKENIZER_FILES[:3])}, ...): give --tokenizer a repo or "
            "directory that has them"
        )
    return path


def _local_dir(name, what: str, revision: str | None, option: str) -> Path | None:
    """``name`` as an existing directory; None for a hub id; an error otherwise."""
    if isinstance(name, str | os.PathLike):
        path = Path(name).expanduser()
        if path.is_dir():
            if revision is not None:
                flag = "--" + option.replace("_", "-")
                raise ValueError(
                    f"{option}={revision!r} ({flag}) picks a snapshot of a Hugging Face Hub "
                    f"id, but {what} {str(name)!r} is a local directory: drop the revision"
                )
            return path
        if isinstance(name, str) and is_hub_id(name):
            return None
        if path.exists():
            raise NotADirectoryError(
                f"{what} {str(name)!r} is a file: give the directory that holds config.json "
                "(or a Hugging Face Hub id, ORG/NAME)"
            )
    raise FileNotFoundError(
        f"{what} directory {str(name)!r} does not exist: give an existing directory or a "
        "Hugging Face Hub id (ORG/NAME)"
    )


class _Hub:
    """One hub id's snapshot lookups, with the errors a user can meet turned into lines
    that say what to do."""

    def __init__(self, repo_id: str, revision, download_dir, what: str):
        self.repo_id = repo_id
        self.revision = revision or "main"
        self.download_dir = download_dir
        self.what = what
        self.cache = hub_cache_dir(download_dir)
        self.offline = envs.HF_HUB_OFFLINE

    def download_command(self) -> str:
        cmd = f"hf download {self.repo_id}"
        if self.revision != "main":
            cmd += f" --revision {self.revision}"
        if self.download_dir is not None:
            cmd += f" --cache-dir {self.cache}"
        return cmd

    def _not_cached(self, missing: str, fix: str = "give a local directory") -> FileNotFoundError:
        """``missing``: how the cache falls short, e.g. "is not in"."""
        return FileNotFoundError(
            f"{self.what} {self.repo_id!r} (revision {self.revision!r}) {missing} the "
            f"Hugging Face cache {self.cache}, and HF_HUB_OFFLINE is set, so nothing was "
            f"downloaded: run once with network access, or `{self.download_command()}`, "
            f"or {fix}"
        )

    def snapshot(self, patterns: list[str], revision: str | None = None) -> Path:
        """The snapshot folder of ``revision`` (default: the one asked for) with the files
        matching ``patterns`` present (downloaded now unless offline)."""
        from huggingface_hub import errors, snapshot_download

        try:
            return Path(
                snapshot_download(
                    self.repo_id,
                    revision=revision or self.revision,
                    cache_dir=self.download_dir,
                    allow_patterns=patterns,
                    local_files_only=self.offline,
                )
            )
        except errors.RevisionNotFoundError:
            raise ValueError(
                f"{self.what} {self.repo_id!r} has no revision {self.revision!r} on the Hugging "
                "Face Hub: give one of its branches, tags or commit hashes"
            ) from None
        except errors.GatedRepoError:
            raise PermissionError(
                f"{self.what} {self.repo_id!r} is gated on the Hugging Face Hub: accept its "
                f"terms at https://huggingface.co/{self.repo_id}, then log in (`hf auth "
                "login`, or set HF_TOKEN)"
            ) from None
        except errors.RepositoryNotFoundError:
            raise FileNotFoundError(
                f"{self.what} {self.repo_id!r} is neither a local directory nor a model on the "
                "Hugging Face Hub (a private one needs `hf auth login` or HF_TOKEN)"
            ) from None
        except errors.LocalEntryNotFoundError as err:
            incomplete = getattr(errors, "IncompleteSnapshotError", ())
            if self.offline:
                how = (
                    "has an incomplete snapshot in" if isinstance(err, incomplete) else "is not in"
                )
                raise self._not_cached(how) from None
            cause = _first_line(err.__cause__ or err)
            raise FileNotFoundError(
                f"{self.what} {self.repo_id!r} (revision {self.revision!r}): the Hugging Face "
                f"Hub could not be reached ({cause}) and the cache {self.cache} does not hold "
                "it: check the network (HF_ENDPOINT, proxies), or give a local directory"
            ) from None
        except errors.HfHubHTTPError as err:
            raise OSError(
                f"{self.what} {self.repo_id!r} (revision {self.revision!r}): the Hugging Face "
                f"Hub answered {_first_line(err)}"
            ) from None

    def fetch_weights(self, path: Path) -> None:
        """Bring the safetensors weights into ``path`` (the snapshot of the config)."""
        index = path / SAFETENSORS_INDEX
        shards = read_safetensors_index(index) if index.is_file() else None
        if not _missing_weights(path, shards):
            return  # cached: no second look-up (which, offline by accident, retries ~20 s)
        # The commit of the snapshot just found: the weights come from the same one.
        self.snapshot(shards or ["*.safetensors"], revision=path.name)
        how = _missing_weights(path, shards)
        if not how:
            return
        if self.offline:
            raise self._not_cached(
                f"{how} in", "use load_format='dummy' (--load-format dummy) for random weights"
            )
        raise FileNotFoundError(
            f"model {self.repo_id!r} (revision {self.revision!r}) {how} on the Hugging Face "
            "Hub; this package loads safetensors checkpoints only (convert a PyTorch .bin "
            "one first), or use load_format='dummy' (--load-format dummy) for random weights"
        )


def _missing_weights(path: Path, shards: list[str] | None) -> str:
    """What of the weights ``path`` lacks (for an error message); "" when nothing."""
    if shards is None:
        return "" if any(path.glob("*.safetensors")) else "has no *.safetensors weights"
    missing = [name for name in shards if not (path / name).is_file()]
    if not missing:
        return ""
    return f"lacks {', '.join(missing)} (listed in its {SAFETENSORS_INDEX})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
