"""The `zerotrain` command line: main.py parses and dispatches, commands/ has one module per subcommand."""
