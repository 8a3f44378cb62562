"""A run's manifest (`manifest.json` in its run directory): what the run was started with, and how a rerun's
differs (`changes_since`, `DriftError`); `settings_key` names a state set aside by its settings. Pure Python.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from conveyor.io.errors import RunDirError

JOURNAL_FILES = ("journal.sqlite", "journal.sqlite-wal", "journal.sqlite-shm")
# The files of a run's state besides the manifest and the lock (never deleted: see acquire_lock).
SPOOL_FILE = "input.spool"  # stdin or a pipe, copied here while a run reads it (io/records/readers/spool.py)
STATE_FILES = (*JOURNAL_FILES, "run.json", "shard.json", SPOOL_FILE)


class DriftError(RunDirError):
    """The input, model or generation config differs from the one the run started with.

    `changed` names the fields that differ: a subset of ("input", "model", "generation_config").
    """

    def __init__(self, path: Path, changed: tuple[str, ...], detail: str):
        self.path, self.changed, self.detail = path, changed, detail
        super().__init__(detail + "; run with --restart to start over (a run's finished rows are set aside, and "
                                  "taken back by a later run with its settings)")


@dataclass(frozen=True)
class Manifest:
    """What a run was started with; a resumed run must match it (see RunDir.check_drift)."""

    input_fingerprint: str
    input_path: str
    model: str
    generation_config: dict
    tool_version: str
    created_at: float  # unix time
    output_path: str
    output_format: str
    state_files: tuple[str, ...] = STATE_FILES  # what `reset` may delete beside the manifest
    config_version: int = 1  # which settings generation_config records (RunSpec.generation_config); 1: before
    # the content of the model's files (core's model_fingerprint); None where unknown (a hub id not downloaded yet,
    # a manifest written before it was recorded): then the model is compared by name alone
    model_fingerprint: str | None = None
    # how the input's bytes are read into records (the reader's `selection`: its format, a datasets split): the same
    # bytes read another way are another input. None in a manifest written before it was recorded (not compared).
    input_selection: dict | None = None

    def changes_since(self, old: Manifest) -> tuple[tuple[str, ...], str]:
        """(what changed from `old` to this manifest: a subset of ("input", "model", "generation_config"), a
        message saying how)."""
        changed: list[str] = []
        parts: list[str] = []
        if old.input_fingerprint != self.input_fingerprint:
            changed.append("input")
            parts.append(f"the input file changed since this run started (fingerprint "
                         f"{_short(old.input_fingerprint)} -> {_short(self.input_fingerprint)})")
        elif None not in (old.input_selection, self.input_selection) and old.input_selection != self.input_selection:
            changed.append("input")
            parts.append(f"the input is read another way than when this run started "
                         f"({', '.join(_diff_config(old.input_selection, self.input_selection))})")
        if old.model != self.model:
            changed.append("model")
            parts.append(f"the model changed since this run started ({old.model} -> {self.model})")
        elif None not in (old.model_fingerprint, self.model_fingerprint) and \
                old.model_fingerprint != self.model_fingerprint:
            changed.append("model")
            parts.append(f"the files of model {self.model} changed since this run started (fingerprint "
                         f"{_short(old.model_fingerprint)} -> {_short(self.model_fingerprint)}): new weights, "
                         "config or tokenizer")
        config_diff = _diff_config(old.generation_config, self.generation_config)
        if config_diff:
            changed.append("generation_config")
            parts.append(f"the generation config changed since this run started ({', '.join(config_diff)})")
        return tuple(changed), "; ".join(parts)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; raises ValueError naming the first missing or bad field."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the manifest is not a JSON object")
        optional = ("state_files", "config_version", "model_fingerprint", "input_selection")
        names = [f.name for f in dataclasses.fields(cls) if f.name not in optional]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"the manifest lacks {', '.join(missing)}")
        if not isinstance(data["generation_config"], dict):
            raise ValueError("the manifest's generation_config is not an object")
        files = data.get("state_files", list(STATE_FILES))  # manifests written before the list existed
        if not isinstance(files, list) or not all(isinstance(f, str) and f and os.path.basename(f) == f
                                                  and f not in (".", "..") for f in files):
            raise ValueError("the manifest's state_files is not a list of file names")
        version = data.get("config_version", 1)  # manifests written before it was recorded
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError("the manifest's config_version is not a positive integer")
        model_fingerprint = data.get("model_fingerprint")
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise ValueError("the manifest's model_fingerprint is not a string")
        selection = data.get("input_selection")
        if selection is not None and not (isinstance(selection, dict) and
                                          all(isinstance(v, str) for v in selection.values())):
            raise ValueError("the manifest's input_selection is not an object of strings")
        return cls(**{n: data[n] for n in names}, state_files=tuple(files), config_version=version,
                   model_fingerprint=model_fingerprint, input_selection=selection)


def settings_key(manifest: Manifest) -> str:
    """What names a set-aside state: a hash of the model and the generation settings (not the input: a run that
    takes it back carries it over to the input as it is then)."""
    text = json.dumps({"model": manifest.model, "generation_config": manifest.generation_config,
                       **({"files": manifest.model_fingerprint} if manifest.model_fingerprint else {})},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _diff_config(old: dict, new: dict) -> list[str]:
    # Compare after a JSON round trip: the stored side was loaded from JSON (tuples became lists).
    new = json.loads(json.dumps(new))
    diffs = []
    for key in sorted(set(old) | set(new), key=str):
        before, after = old.get(key, _UNSET), new.get(key, _UNSET)
        if before != after:
            diffs.append(f"{key}: {_show(before)} -> {_show(after)}")
    return diffs


_UNSET = object()


def _show(value: object) -> str:
    return "<unset>" if value is _UNSET else json.dumps(value)


def _short(fingerprint: str) -> str:
    algo, _, digest = fingerprint.rpartition(":")
    return f"{algo}:{digest[:12]}" if algo else fingerprint[:12]
