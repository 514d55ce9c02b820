"""`python -m streamrl.cli`: the `streamrl` command."""

from streamrl.cli import main

main()
