"""An option's key as it is written on the command line: max_tokens -> --max-tokens (config files take either)."""


def option_name(key: str) -> str:
    return "--" + key.replace("_", "-")
