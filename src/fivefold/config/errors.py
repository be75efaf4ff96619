"""The one error of a bad input: a sentence naming the option (or file) and the fix.

Every layer raises it for what a user gave it (a key, a folder, a checkpoint); the CLI prints the
sentence and exits, so no traceback reaches the user for a bad input.
"""


class ConfigError(ValueError):
    """A bad configuration, explained in one sentence."""


def require(ok: bool, message: str) -> None:
    """Raise the one sentence `message` unless `ok`: the shape of every check of the config layer."""
    if not ok:
        raise ConfigError(message)
