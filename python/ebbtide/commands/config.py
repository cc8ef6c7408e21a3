"""`ebbtide config`: every EBBTIDE_* setting with its value here, its default
and its meaning (the core's table, cpp/src/util/settings.cpp)."""
import json

from ebbtide import _settings


def register(subparsers):
    p = subparsers.add_parser("config", help="the EBBTIDE_* settings: value in this environment, default, "
                                             "meaning")
    p.add_argument("--json", action="store_true", help="one object per setting")
    p.add_argument("--markdown", action="store_true",
                   help="the tables of docs/configuration.md, one per section")
    p.set_defaults(func=run)


def markdown_tables(rows) -> dict:
    """Section -> its markdown table, as docs/configuration.md has it."""
    out: dict = {}
    for s in rows:
        table = out.setdefault(s.section, ["| variable | default | meaning |", "| --- | --- | --- |"])
        table.append(f"| `{s.name}` | {s.default} | {s.meaning} |")
    return {section: "\n".join(lines) for section, lines in out.items()}


def run(args):
    from ebbtide import _core

    rows = _settings.table()
    if args.markdown:
        for section, table in markdown_tables(rows).items():
            print(f"## {section}\n\n{table}\n")
        return 0
    # Every variable is read and checked: a bad value shows as an error line
    # naming it, and the command exits non-zero.
    values, errors = {}, []
    for s in rows:
        try:
            values[s.name] = _core.env_setting(s.name)
        except ValueError as e:
            values[s.name] = None
            errors.append(str(e))
    if args.json:
        print(json.dumps([dict(name=s.name, kind=s.kind, section=s.section, value=values[s.name],
                               default=s.default, meaning=s.meaning) for s in rows], indent=2))
    else:
        width = max(len(s.name) for s in rows)
        for s in rows:
            v = values[s.name]
            shown = "unset" if v is None else repr(v)
            print(f"{s.name:<{width}}  {shown:<14} default {s.default.replace(chr(96), '')}")
    for e in errors:
        print(f"error: {e}")
    return 2 if errors else 0
