"""A run's adapter on the Hugging Face Hub, as transformers' Trainer pushes with ``push_to_hub`` (TRL's
GRPOTrainer inherits it), through huggingface_hub's ``HfApi``, and a finished run pushed whole
(``push_run``: ``lora-grpo push``):

- **The repository** is created (or found: ``exist_ok``) when the trainer is built, so that a missing login
  or a wrong name stops the script before it trains, in one message with the fix (``HubPushError``).
- **Each checkpoint a save step writes** is pushed in the background while training goes on, by
  ``hub_strategy``: ``every_save`` its adapter, tokenizer and model card to the repository's root;
  ``checkpoint`` also the whole checkpoint to ``last-checkpoint/`` (resumable from the hub);
  ``all_checkpoints`` to ``checkpoint-N/``; ``end`` nothing. While one push is still uploading the next is
  skipped, unless ``hub_always_push``; pushes upload one after another, in the order they were made.
- **The final push** (``push_folder``: ``trainer.push_to_hub()``, or ``save_model()`` with ``push_to_hub``)
  uploads output_dir after the background pushes finish, without what is not the model's: the checkpoints,
  previous runs, the ``adapter/`` copy of the root's files, ``completions.jsonl`` (the prompts and answers
  trained on) and the run's lock.
- **A card of ours** is pushed loading the adapter from the repository (``model_card.relocated``); the one on
  disk keeps its path.

Where this differs from transformers': a checkpoint is pushed from a snapshot of its files (hard links beside
it, made at once), so that rotation (``save_total_limit``) or a later save cannot change a file under an
upload; a background push that fails, or cannot start, is a warning naming the checkpoint, the error and that
it is kept on disk (transformers' waits over it in silence), and training goes on; a final push that fails is
``HubPushError`` naming the folder, which is left as it was, and how to push it again. Nothing on the hub is
deleted: files of the same names are replaced, as ``upload_folder`` does.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ..config_checks import HUB_STRATEGIES
from ..model.adapters import POLICY_DIR
from . import model_card
from .checkpoint import resolve_adapter
from .run_dir import LOCK_NAME, SNAPSHOT_PREFIX, held_by

logger = logging.getLogger(__name__)

# A checkpoint's files that are not the model's: its adapters for resuming, optimizer and loop state
# (pushed whole only to last-checkpoint/ or checkpoint-N/).
CHECKPOINT_ONLY = ["policy/*", "reference/*", "*.pt", "lora_grpo_state.json", "trainer_state.json"]
# output_dir's files that are not the model's (the model is its root's adapter, tokenizer and card, with the
# run's config, metrics and results beside it). "_*" and "checkpoint-*" are transformers' own patterns.
NOT_PUSHED = [
    "_*",
    "checkpoint-*",
    "previous-run-*",
    "adapter/*",
    "completions.jsonl",
    LOCK_NAME,
    f"{SNAPSHOT_PREFIX}*",
]


# A run's records pushed beside its final adapter: how it was trained and what it logged (not completions.jsonl,
# the prompts and answers trained on).
RUN_RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "metrics.png")


class HubPushError(RuntimeError):
    """A push to the hub failed: the message names the repository, the error and what to do."""


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def upload_command(repo_id: str, folder: Path, path_in_repo: str, exclude: list[str] | tuple = ()) -> str:
    """The `hf upload` command line that pushes `folder` as these pushes do (for a failure's message)."""
    words = ["hf", "upload", repo_id, str(folder), path_in_repo]
    for pattern in exclude:
        words += ["--exclude", pattern]
    return "`" + shlex.join(words) + "`"


def _api():
    from huggingface_hub import HfApi

    # the hub's record of which library pushed (as transformers' hf_api() names itself)
    return HfApi(library_name="lora_grpo", library_version=model_card.package_version("lora_grpo"))


@dataclass(frozen=True)
class Pushed:
    """What push_trained pushed (in resolve_adapter's words) and its commit's address."""

    what: str
    commit_url: str


@dataclass
class _Push:
    """One checkpoint's background uploads and the snapshot they read; `ended` once the last has ended and its
    failure (if any) was said and the snapshot removed (HubRepo._ended)."""

    checkpoint: Path
    futures: list[Future]
    snapshot: Path
    ended: threading.Event = field(default_factory=threading.Event)

    def remove_snapshot(self) -> None:
        shutil.rmtree(self.snapshot, ignore_errors=True)


def _snapshot(folder: Path, also: tuple[Path, ...] = (), inside: Path | None = None) -> Path:
    """A copy of `folder`'s files as they are now (and of the files `also`, at its root), in a new directory
    `inside` (None: the system's temporary directory): hard links where it shares their file system (instant, no
    space), else copies. lora_grpo writes a checkpoint's files once, under new names renamed into place, so a link
    keeps the bytes saved whatever later saves and rotation do. Nothing is left behind when it fails."""
    root = Path(tempfile.mkdtemp(prefix=f"{SNAPSHOT_PREFIX}{folder.name}.", dir=inside))
    try:
        files = [(path, root / path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()]
        for path, target in [*files, *((path, root / path.name) for path in also)]:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:  # another file system, or none with hard links
                shutil.copyfile(path, target)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _card_for(snapshot: Path, repo_id: str) -> None:
    """The snapshot's model card (ours) made to load the adapter from `repo_id`, not from the disk it was saved
    on. Its README.md is a link to the saved card: unlinked, never written through."""
    card = snapshot / "README.md"
    if card.is_file() and model_card.is_ours(card):
        text = card.read_text(encoding="utf-8")
        card.unlink()
        card.write_text(model_card.relocated(text, repo_id), encoding="utf-8")


class HubRepo:
    """One hub model repository a run pushes to (``create`` makes or finds it)."""

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        revision: str | None = None,
        strategy: str = "every_save",
        always_push: bool = False,
    ):
        strategy = getattr(strategy, "value", strategy)  # transformers' HubStrategy, or its value
        if strategy not in HUB_STRATEGIES:
            raise ValueError(f"hub_strategy {strategy!r}: one of {', '.join(HUB_STRATEGIES)}")
        self.repo_id, self.token, self.revision = repo_id, token, revision
        self.strategy, self.always_push = strategy, always_push
        self._pushes: list[_Push] = []
        # what a failed checkpoint push's warning says of the model's push, in the entry point's words
        self.final_hint = "trainer.push_to_hub() pushes the model at the end"
        # one client for every push: its one worker thread uploads the pushes in the order they were made (a
        # client each would upload them side by side, and an older checkpoint could land last)
        self.api = _api()

    @classmethod
    def create(
        cls,
        name: str,
        *,
        token: str | None = None,
        private: bool | None = None,
        fix: str = "give hub_token a token that may write there, check hub_model_id, or set push_to_hub=False to "
        "train without pushing",
        **kwargs,
    ) -> HubRepo:
        """The repository `name` (``user/model``, or a bare name under the token's user), created if it is not
        there; HubPushError when the hub refuses or cannot be reached, its message ending in `fix`."""
        try:
            url = _api().create_repo(name, token=token, private=private, exist_ok=True)
            # the hub commits only to a branch that exists (as `hf upload` makes it)
            if kwargs.get("revision"):
                _api().create_branch(url.repo_id, branch=kwargs["revision"], token=token, exist_ok=True)
        except Exception as error:  # the hub's HTTP errors, offline mode, no network: all say the same here
            raise HubPushError(
                f"could not create or reach the hub repository {name!r} ({_reason(error)}). Log in "
                f"(`hf auth login`) or {fix}"
            ) from error
        return cls(url.repo_id, token=token, **kwargs)

    # ------------------------------------------------------------------ background pushes of checkpoints
    def busy(self) -> bool:
        """Whether a checkpoint's push is still uploading."""
        self._pushes = [push for push in self._pushes if not push.ended.is_set()]
        return bool(self._pushes)

    def pending(self) -> list[str]:
        """The checkpoints whose pushes are still uploading (a stopped run's process ends once they have)."""
        return [push.checkpoint.name for push in self._pushes if not push.ended.is_set()]

    def still_uploading(self) -> str | None:
        """What a run that failed or stopped says of its pushes still uploading (its process ends once they
        have; none is cut off), or None."""
        pending = self.pending()
        if not pending:
            return None
        return f"the push of {', '.join(pending)} to {self.repo_id} is still uploading: this process ends when it has"

    @property
    def pushes_whole_checkpoints(self) -> bool:
        """Whether the strategy pushes whole checkpoints (last-checkpoint/ or checkpoint-N/), to resume from."""
        return self.strategy in ("checkpoint", "all_checkpoints")

    def wants(self) -> bool:
        """Whether the checkpoint just saved is pushed: a strategy that pushes checkpoints, and the last push
        done (or hub_always_push)."""
        return self.strategy != "end" and (self.always_push or not self.busy())

    def push_checkpoint(self, checkpoint: Path, message: str, *, root: bool = True) -> None:
        """Start the uploads of `checkpoint` (a snapshot of it beside it, its card loading the adapter from this
        repository) by the strategy, in the background; `root` False: only the whole checkpoint's (a run's last,
        whose adapter the final push brings to the root). A failure to start them is a warning, as a failed upload
        is: training goes on."""
        checkpoint = Path(checkpoint)
        if not root and not self.pushes_whole_checkpoints:
            return  # nothing of it to push
        try:
            snapshot = _snapshot(checkpoint, inside=checkpoint.parent)
        except Exception as error:  # a full disk, a checkpoint gone: the push, not the run, fails
            self._warn(checkpoint, error)
            return
        try:
            _card_for(snapshot, self.repo_id)
            futures = self._uploads(checkpoint, snapshot, message, root)
        except Exception as error:
            shutil.rmtree(snapshot, ignore_errors=True)
            self._warn(checkpoint, error)
            return
        push = _Push(checkpoint, futures, snapshot)
        self._pushes.append(push)
        # when its last upload ends (the client's one worker runs them in order, so the others have ended): a
        # failure said at once, also in a run that failed or stopped since, which waits for no one; the snapshot gone
        futures[-1].add_done_callback(lambda _: self._ended(push))

    def _ended(self, push: _Push) -> None:
        try:
            push.remove_snapshot()
            errors = [f.exception() for f in push.futures if f.exception() is not None]
            if errors:
                self._warn(push.checkpoint, errors[0])
        finally:
            push.ended.set()

    def _uploads(self, checkpoint: Path, snapshot: Path, message: str, root: bool) -> list[Future]:
        futures = []
        if root:
            futures.append(
                self._upload(snapshot, message, ignore_patterns=CHECKPOINT_ONLY, run_as_future=True)
            )
        if self.pushes_whole_checkpoints:
            whole = "last-checkpoint" if self.strategy == "checkpoint" else checkpoint.name
            futures.append(
                self._upload(snapshot, f"{message}, checkpoint", path_in_repo=whole, run_as_future=True)
            )
        return futures

    def _upload(self, folder: Path, message: str, *, token=None, revision=None, **kwargs):
        """huggingface_hub's upload_folder of `folder` to this repository, with its token and branch unless given
        (`kwargs`: upload_folder's own: patterns, path_in_repo, run_as_future)."""
        return self.api.upload_folder(
            repo_id=self.repo_id,
            folder_path=folder,
            commit_message=message,
            token=token if token is not None else self.token,
            revision=revision if revision is not None else self.revision,
            **kwargs,
        )

    def wait(self, say=logger.info) -> None:
        """Wait for the background pushes to finish (`say` names them first); a failed one is a warning, said as
        its upload ended."""
        pending = self.pending()
        if pending:
            say(
                f"waiting for the push of {', '.join(pending)} to the hub repository {self.repo_id} to finish"
            )
        for push in self._pushes:
            push.ended.wait()
        self.busy()

    def _warn(self, checkpoint: Path, error: BaseException) -> None:
        kept = (
            f"the checkpoint is kept at {checkpoint}: {upload_command(self.repo_id, checkpoint, checkpoint.name)} "
            "pushes it"
            if checkpoint.is_dir()
            else f"{checkpoint} has since been rotated away (save_total_limit)"
        )
        logger.warning(
            "pushing %s to the hub repository %s failed (%s); training goes on, %s; %s",
            checkpoint.name,
            self.repo_id,
            _reason(error),
            self.final_hint,
            kept,
        )

    # ------------------------------------------------------------------ a trained adapter, in one commit
    def push_trained(self, path: str | os.PathLike, message: str) -> Pushed:
        """Push what `path` holds in one commit, after the background pushes: a run directory's final adapter/
        with the run's RUN_RECORDS, a checkpoint's adapter with its tokenizer and card (not its optimizer, loop
        state or reference), or an adapter directory as it is. A card of ours is pushed loading the adapter from
        this repository; nothing on disk changes. HubPushError when the upload fails."""
        path = Path(path)
        adapter, what = resolve_adapter(path)
        # a checkpoint: its root holds the adapter with its tokenizer and card
        if adapter == path / POLICY_DIR:
            folder, also, ignore = path, (), CHECKPOINT_ONLY
        elif adapter == path / "adapter":  # a run: its final adapter, and how it was trained
            folder, also, ignore = adapter, tuple(path / n for n in RUN_RECORDS if (path / n).is_file()), None
        else:  # an adapter directory; or a TRL script's output_dir, its adapter saved among the run's files
            folder, also, ignore = adapter, (), NOT_PUSHED
        self.wait()
        snapshot = _snapshot(folder, also)
        try:
            _card_for(snapshot, self.repo_id)
            info = self._upload(snapshot, message, ignore_patterns=ignore)
        except Exception as error:
            again = [
                "lora-grpo",
                "push",
                str(path),
                self.repo_id,
                *(["--revision", self.revision] if self.revision else []),
            ]
            raise HubPushError(
                f"pushing {what} to the hub repository {self.repo_id!r} failed ({_reason(error)}). Nothing on disk "
                f"changed: push it again with `{shlex.join(again)}`"
            ) from error
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)
        return Pushed(what, info.commit_url)

    # ------------------------------------------------------------------ the final push
    def push_folder(
        self,
        folder: Path,
        message: str,
        *,
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
    ):
        """Upload `folder` (output_dir) without NOT_PUSHED, after the background pushes: the CommitInfo, or a
        Future of it when not `blocking`. HubPushError when the upload fails (the folder is as it was)."""
        self.wait()
        try:
            return self._upload(
                folder,
                message,
                token=token,
                revision=revision,
                ignore_patterns=NOT_PUSHED,
                run_as_future=not blocking,
            )
        except Exception as error:
            raise HubPushError(
                f"push_to_hub: uploading {folder} to the hub repository {self.repo_id!r} failed ({_reason(error)}). "
                f"The folder is as it was: push it again with trainer.push_to_hub(), or from a shell with "
                f"{upload_command(self.repo_id, folder, '.', NOT_PUSHED)}"
            ) from error


# ----------------------------------------------------------------------------- a finished run, pushed whole
def push_run(
    path: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    message: str = "Upload the adapter trained with lora_grpo",
) -> Pushed:
    """Push a trained adapter to the hub repository `repo_id` (created if needed) in one commit
    (HubRepo.push_trained: a run's final adapter with its records, a checkpoint's adapter, an adapter
    directory). CheckpointError for a path that holds no adapter, HubPushError when the hub refuses."""
    resolve_adapter(path)  # a path without an adapter is refused before the hub is asked anything
    training = held_by(path)
    if training:
        raise HubPushError(
            f"{path} is in use by a run that is training ({training}): its adapter/ and metrics are not the run's "
            "last. Push when it has ended, or push one of its checkpoints (checkpoint-N) now"
        )
    fix = "pass --token (token=) a token that may write there, and check the repository's name"
    repo = HubRepo.create(repo_id, token=token, private=private, revision=revision, fix=fix)
    return repo.push_trained(path, message)
