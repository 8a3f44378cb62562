"""What the CLI says beside a command's output: notes on stderr (`say`), and the libraries' own chatter turned
down before a model loads (`quiet_libraries`)."""

from __future__ import annotations

import sys


def say(note: str) -> None:
    """A note for the user, on stderr."""
    sys.stderr.write(f"conveyor: {note}\n")


def quiet_libraries() -> None:
    """transformers' warnings and progress bars off, and the tokenizers' thread pool off (it warns after a fork)."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - a broken transformers install shows itself at load time
        pass
