"""One module per user subcommand; each has add_parser(subparsers) and its command function."""
