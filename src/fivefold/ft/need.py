"""torchft is an optional dependency (the `[ft]` extra): imported here, once, with a sentence when
it is missing."""

from __future__ import annotations

from fivefold.config import ConfigError


def torchft():
    """The torchft package, or a ConfigError naming the extra that installs it."""
    try:
        import torchft
    except ImportError:
        raise ConfigError("ft.replicas > 0 needs the torchft package: pip install 'fivefold[ft]' "
                          "(or set ft.replicas=0)") from None
    return torchft
