"""The command-line interface: the only place typer and rich are imported."""
