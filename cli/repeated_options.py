"""An option given more than once on one command line: a list option (--keep-fields, --served-model-name, --choice)
takes every value given, as one comma-separated list; any other keeps the last value, as Click does, and a warning
names the values it drops (Click would drop them without a word). --stop is made to repeat; switches (--quiet ...
--no-quiet) say by the last one given."""

from __future__ import annotations

from typing import Any

from conveyor.cli.config import holds_list


def merge_repeated_options(group: Any, args: list[str]) -> tuple[list[str], list[str]]:
    """(`args` with each list option's values joined into its first occurrence, the warnings to print) for a
    `conveyor` command line. `group`: the app's Click group (Typer's own copy of Click: read by attribute)."""
    command = getattr(group, "commands", {}).get(args[0]) if args else None
    if command is None:
        return args, []
    takes_value = {opt: param for param in command.params if param.param_type_name == "option"
                   and not param.is_flag and not param.count for opt in param.opts}
    given: dict[str, list[tuple[str, int, str]]] = {}  # key -> (the option as written, its index, its value)
    i = 1
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        param = takes_value.get(name)
        if param is not None:
            at = i
            if not eq:
                i += 1
                value = args[i] if i < len(args) else ""
            if not param.multiple:
                given.setdefault(param.name, []).append((name, at, value))
        i += 1
    merged, dropped, warnings = list(args), set(), []
    for key, uses in given.items():
        if len(uses) < 2:
            continue
        name, first = uses[0][0], uses[0][1]
        values = [value for _, _, value in uses]
        if holds_list(key):
            merged[first] = f"{name}={','.join(values)}"
            if "=" not in args[first]:
                dropped.add(first + 1)
            for _, at, _ in uses[1:]:
                dropped.update({at} if "=" in args[at] else {at, at + 1})
        else:
            shown = ", then ".join(repr(v) for v in values)
            warnings.append(f"{name} is given {len(values)} times ({shown}): the last, {values[-1]!r}, is used")
    return [arg for i, arg in enumerate(merged) if i not in dropped], warnings
