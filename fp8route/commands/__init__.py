"""`fp8route` subcommands, one module each, registered in fp8route/cli.py."""
