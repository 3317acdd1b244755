"""``python -m persisting.cli``: the same as the ``persisting`` console script."""

from persisting.cli.app import main

main()
