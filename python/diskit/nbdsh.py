"""nbdsh's command line over diskit's client: ``diskit nbdsh`` (or
``python3 -m diskit.nbdsh``) with nbdsh's options, in command-line order:
``-u URI`` connects the handle ``h``, ``--base-allocation`` asks for
base:allocation, ``--opt-mode`` asks for option mode, ``-c CMD`` runs a
Python statement (``-c -``: the statements on standard input); ``-n``
makes no handle. Without ``-c``, an interactive shell."""

import argparse
import code
import sys

from diskit import nbd


class _InOrder(argparse.Action):
    """Options kept in command-line order, as nbdsh runs them."""

    def __init__(self, option_strings, dest, nargs=None, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs,
                         default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        kind = self.dest
        if kind == "command" and value == "-":
            kind = "stdin"
        if kind != "command" and kind != "stdin":
            namespace.needs_handle = True
        namespace.steps = namespace.steps + [(kind, value)]


def _parser():
    p = argparse.ArgumentParser(
        prog="nbdsh", description="Network Block Device (NBD) shell")
    p.set_defaults(needs_handle=False, steps=[])
    p.add_argument("--base-allocation", action=_InOrder, nargs=0,
                   help='request the "base:allocation" meta context')
    p.add_argument("-c", "--command", action=_InOrder,
                   help="run a Python statement (may be used multiple times)")
    p.add_argument("-n", action="store_true",
                   help="do not create the implicit handle 'h'")
    p.add_argument("--opt-mode", action=_InOrder, nargs=0,
                   help="request opt mode during connection")
    p.add_argument("-u", "--uri", action=_InOrder, help="connect to NBD URI")
    p.add_argument("--connect", dest="uri", action=_InOrder,
                   help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="enable verbose debugging")
    p.add_argument("-V", "--version", action="store_true",
                   help="display version information")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.n and args.needs_handle:
        print("error: -n option cannot be used with --base-allocation, "
              "--opt-mode or --uri", file=sys.stderr)
        return 1
    if args.version:
        h = nbd.NBD()
        print("nbdsh %s" % h.get_version())
        print("%s %s" % (h.get_package_name(), h.get_version()))
        return 0
    scope = {"nbd": nbd}
    if not args.n:
        h = nbd.NBD()
        h.set_handle_name("nbdsh")
        scope["h"] = h
    run = {
        "command": lambda arg: exec(arg, scope, scope),
        "stdin": lambda arg: exec(sys.stdin.read(), scope, scope),
        "base_allocation": lambda arg: scope["h"].add_meta_context(
            nbd.CONTEXT_BASE_ALLOCATION),
        "opt_mode": lambda arg: scope["h"].set_opt_mode(True),
        "uri": lambda arg: scope["h"].connect_uri(arg),
    }
    try:
        for kind, arg in args.steps:
            run[kind](arg)
    except nbd.Error as e:
        print("nbdsh: command line script failed: %s" % e.string,
              file=sys.stderr)
        return 1
    if not any(kind in ("command", "stdin") for kind, _ in args.steps):
        sys.ps1 = "nbd> "
        code.interact(banner="nbdsh (diskit): the handle is 'h', the "
                      "module 'nbd'.", local=scope, exitmsg="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
