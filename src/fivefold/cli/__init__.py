"""The `fivefold` command: commands.py parses, calls and prints; help_text.py holds every help text."""

from fivefold.cli.commands import main

__all__ = ["main"]
