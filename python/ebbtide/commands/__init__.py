"""Subcommands of the `ebbtide` CLI, one module each (see ebbtide.cli)."""
import json
import sys


def report(args, result, format_table, plot=None):
    """Ends a measuring command (demo, rok): the PNG when --png names one,
    then JSON on stdout with --json, else the table. Returns the exit code."""
    if plot is not None and getattr(args, "png", None):
        plot(result, args.png)
        result["png"] = args.png
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    else:
        print(format_table(result))
        if result.get("png"):
            print(f"plot: {result['png']}")
    return 0
