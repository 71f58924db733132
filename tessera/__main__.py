"""``python -m tessera`` runs the CLI."""

from tessera.cli.main import main

main()
