"""``python -m app.cli ...`` (e.g. under ``torchrun``) is the ``casi`` command."""

from app.cli import main

main()
