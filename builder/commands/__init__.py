"""One module per `kvq` subcommand; each exposes `command`."""
