"""`python -m shardwise.cli`: the `shardwise` command, as the console script runs it."""

from shardwise.cli.app import main

main()
