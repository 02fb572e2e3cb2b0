"""``python -m jaxckpt`` is the ``jaxckpt`` command."""

from .cli import console

console()
