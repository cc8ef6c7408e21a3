"""Subcommands of the `ebbtide` CLI, one module each (see ebbtide.cli)."""
