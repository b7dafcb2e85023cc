"""The ``zerofix`` command (also ``python -m zerofix``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def _status(args) -> int:
    import importlib

    from zerofix import catalogue, patching
    from zerofix.versions import installed_version

    if args.apply:
        # Show what patch() really does here: enable, then import every target module.
        patching.patch()
        for fix in catalogue.FIXES:
            installed = installed_version(fix.dist)
            # only the fixes in range: a target module of another release may not exist in this one (issue 42)
            if installed is None or not patching.version_in_range(installed, fix.affected):
                continue
            for module in fix.modules:
                try:
                    importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001 - reported as the fix's failure
                    sys.stderr.write(f"zerofix: could not import {module}: {exc!r}\n")
    records = patching.status()
    if args.json:
        print(json.dumps([r.to_dict() for r in records], indent=2))
        return 0
    import shutil

    print("\n".join(status_table(records, shutil.get_terminal_size((120, 24)).columns)))
    print()
    print(verdict_line(records))
    return 0


def status_table(records, width: int = 120) -> list[str]:
    """One row per fix; the reason wraps under its own column (a reason runs to 430 characters), so a row stays a
    row at the terminal's width (at least 40 characters of reason per line)."""
    import textwrap

    rows = [("fix", "state", "installed", "affected", "reason")]
    rows += [(r.id, r.state, f"{r.dist} {r.installed or '-'}", r.affected, r.reason) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    indent = sum(widths) + 2 * 4
    lines = []
    for row in rows:
        head = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  "
        reason = textwrap.wrap(row[4], max(40, width - indent), break_on_hyphens=False) or [""]
        lines.append(head + reason[0])
        lines += [" " * indent + more for more in reason[1:]]
    return lines


OPT_IN = "opt-in"  # verdict_line's group of in-range opt-in entries not applied
SWITCH = "switch"  # verdict_line's group of the switches (catalogue.Fix.switch): not bugs


def verdict_line(records) -> str:
    """The answer to "do I need zerofix here?", from the status records."""
    from zerofix import catalogue, patching
    from zerofix.versions import version_in_range

    opt_in = {f.id for f in catalogue.FIXES if f.opt_in}
    switches = {f.id for f in catalogue.FIXES if f.switch}

    def group(record) -> str:
        if record.id in switches:
            return SWITCH  # not a bug: listed apart, never counted
        waiting = record.state in (patching.INACTIVE, patching.DISABLED)
        if waiting and record.id in opt_in and record.installed and version_in_range(record.installed, record.affected):
            return OPT_IN
        return record.state

    groups = (
        (patching.APPLIED, "fixed now: {}"),
        (patching.PENDING, "enabled, applied when the library is imported: {}"),
        (patching.INACTIVE, "not enabled: {} (enable with ZEROFIX=1, zerofix.patch() or 'zerofix run -- <launcher>')"),
        (OPT_IN, "opt-in, applied only when named, because a right usage looks the same: {} (see its reason; "
                 "ZEROFIX_OPT_IN=<id> or zerofix.patch(opt_in=[...]))"),
        (patching.TARGET_CHANGED, "not applied, the code changed shape: {} (see the reason)"),
        (patching.FAILED, "not applied, applying failed: {} (see the reason)"),
    )
    parts = []
    for state, text in groups:
        ids = [r.id for r in records if group(r) == state]
        if ids:
            parts.append(text.format(", ".join(ids)))
    on = [r.id for r in records if group(r) == SWITCH and r.state == patching.APPLIED]
    switch = (f" Switches on: {', '.join(on)}." if on else
              " Switches, applied only when named (ZEROFIX_OPT_IN=<id>): " + ", ".join(sorted(switches)) + "."
              if switches & {r.id for r in records} else "")
    if not parts:
        return ("You do not need zerofix here: no installed release is in an affected range "
                "('zerofix check' proves the stack with real runs)." + switch)
    count = sum(group(r) in {s for s, _ in groups} for r in records)
    details = "; ".join(parts)
    return (f"{count} known bug(s) of the installed releases concern this environment. "
            f"{details[0].upper()}{details[1:]}.{switch}")


def _link_text(url: str) -> str:
    """github.com/<owner>/<repo>/(issues|pull)/<n> -> "<repo> #<n>"; .../releases/tag/<t> -> "<repo> <t>"."""
    parts = url.rstrip("/").split("/")
    if parts[-2] == "tag":
        return f"{parts[-4]} {parts[-1]}"
    return f"{parts[-3]} #{parts[-1]}"


def markdown_table() -> str:
    """The README's fix table, generated from the catalogue (a test keeps the README in sync)."""
    from zerofix import catalogue

    lines = ["| fix | library | affected releases | fixed upstream in | where | upstream |",
             "|---|---|---|---|---|---|"]
    for fix in catalogue.FIXES:
        links = ", ".join(f"[{_link_text(u)}]({u})" for u in fix.upstream)
        fixed = "(a switch, not a bug)" if fix.switch else fix.fixed_in or "not yet"
        lines.append(f"| `{fix.id}` | {fix.dist} | `{fix.affected}` | {fixed} "
                     f"| {fix.where} | {links} |")
    return "\n".join(lines)


def _catalogue(args) -> int:
    from zerofix import catalogue

    if args.markdown:
        print(markdown_table())
    else:
        for fix in catalogue.FIXES:
            print(f"{fix.id}: {fix.title} [{fix.dist} {fix.affected}]")
    return 0


def run_environment(environ, fixes=None, disable=None) -> dict:
    """The environment ``zerofix run`` gives its command: the bootstrap directory first on PYTHONPATH
    (activation by itself, and launchers forward PYTHON* variables to every rank and node)."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts])
    if fixes:
        env["ZEROFIX"] = fixes
    if disable:
        env["ZEROFIX_DISABLE"] = disable
    return env


def _run(args, parser) -> int:
    from zerofix import catalogue

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command: zerofix run -- torchrun --nproc_per_node 2 train.py")
    for option, value in (("--fixes", args.fixes), ("--disable", args.disable)):
        if value is None:
            continue
        items = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in items if v not in catalogue.ids()]
        if unknown or not items:
            parser.error(f"{option} {value!r}: unknown fix id(s) {', '.join(unknown) or '(none given)'}; "
                         f"give a comma list of: {', '.join(catalogue.ids())} (or leave {option} out)")
    env = run_environment(os.environ, args.fixes, args.disable)
    from zerofix.activation import ConfigError, read_environment

    try:
        read_environment(env, default_on=True)
    except ConfigError as exc:  # the inherited ZEROFIX / ZEROFIX_DISABLE, not the flags (checked above)
        from zerofix.activation import said_already

        if said_already(str(exc)):  # this process's own start-up said it in full already
            parser.error("the ZEROFIX* variable named in the warning above is not valid (set in the environment "
                         "zerofix run inherits)")
        parser.error(f"{exc} (set in the environment zerofix run inherits)")
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:  # a shell's codes: 127 not found, 126 found but not runnable
        sys.stderr.write(f"zerofix run: command not found: {command[0]}\n")
        return 127
    except OSError as exc:  # PermissionError, IsADirectoryError, ENOEXEC, ...
        why = "is a directory" if os.path.isdir(command[0]) else (exc.strerror or type(exc).__name__).lower()
        sys.stderr.write(f"zerofix run: cannot run {command[0]}: {why} (make it executable, or run it "
                         f"through its interpreter: zerofix run -- python {command[0]})\n")
        return 126
    return 0  # not reached


DESCRIPTION = ("Numerically correct distributed training on the library versions you pin. Start with "
               "'zerofix status' (what each fix does here), then 'zerofix check' (prove it with tiny real runs).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerofix", description=DESCRIPTION)
    from zerofix import __version__

    parser.add_argument("--version", action="version", version=f"zerofix {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="{status,check,run,catalogue}")
    p = sub.add_parser("check", help="prove on the installed libraries that training steps are correct: tiny "
                                     "real runs, unpatched and patched, against a single-process reference")
    from zerofix.check.command import add_arguments  # argparse only: no ML library imported

    add_arguments(p)
    p = sub.add_parser("status", help="what each fix does on the installed libraries")
    p.add_argument("--json", action="store_true", help="machine-readable records")
    p.add_argument("--apply", action="store_true",
                   help="call zerofix.patch() and import the target modules first, to show the real outcome")
    p = sub.add_parser("catalogue", help="list the known fixes")
    p.add_argument("--markdown", action="store_true", help="the README table")
    p = sub.add_parser("run", help="run a command (torchrun, deepspeed, accelerate launch, python) with "
                                   "zerofix active in every Python process it starts")
    p.add_argument("--fixes", help="comma list of fix ids (default: all)")
    p.add_argument("--disable", help="comma list of fix ids to leave alone")
    p.add_argument("command", nargs=argparse.REMAINDER)
    for name, sub_command in sub.choices.items():
        _one_line_errors(sub_command, name)
    return parser


def _one_line_errors(sub, name: str) -> None:
    """``sub.error`` prints one line naming the problem and where the options are (exit 2): the usage block
    argparse prints first would bury the line that matters."""
    sub.error = lambda message: sub.exit(2, f"zerofix {name}: error: {message} ('zerofix {name} --help' lists the "
                                            "options)\n")


def sub_parser(parser, name):
    """The subcommand's parser (its error() prints one line, exit 2)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (zerofix status --json | head): the rest of the output has nowhere to go
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        parser.exit(2, "\nzerofix: choose a command, e.g. 'zerofix status'\n")
    if extra:  # reported by the subcommand that was given them, with its own usage
        sub_parser(parser, args.cmd).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "check":
        from zerofix.check import command

        return command.main(args, sub_parser(parser, "check"))
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "catalogue":
        return _catalogue(args)
    return _run(args, sub_parser(parser, "run"))
