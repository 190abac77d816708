"""`cartridges store usage` (disk per stage, run and fleet root) and `cartridges store prune` (retention)."""

from __future__ import annotations

import argparse

from cli.common import add_common, command, emit_json


def add_parsers(sub) -> None:
    p = sub.add_parser("store", help="disk used by the store and its fleets; prune what the retention policy allows")
    actions = p.add_subparsers(dest="store_command", required=True)
    for name, text in (("usage", "disk used per stage, per run and per fleet root (hard links counted once)"),
                       ("prune", "remove superseded artifacts and fleet versions (see docs/RELIABILITY.md)")):
        q = actions.add_parser(name, help=text, description=text)
        q.add_argument("--store", default=None, help="artifact store root (default $CARTRIDGES_HOME or ./artifacts)")
        q.add_argument("--fleet", action="append", default=[],
                       help="a fleet root to include (repeatable; roots the store's runs published to are found)")
        if name == "prune":
            q.add_argument("--keep", type=int, default=3, help="published fleet versions to keep per root")
            q.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
        add_common(q)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@command("store")
def cmd_store(args: argparse.Namespace) -> int:
    from cartridges.core.errors import CartridgeError
    from storage import Store, format_table
    from storage.retention import prune, usage

    store = Store(args.store, read_only=args.store_command == "usage" or args.dry_run)
    if args.store_command == "usage":
        u = usage(store, args.fleet)
        print(format_table(["stage", "artifacts", "complete", "failed", "running", "MiB"],
                           [(k, v["artifacts"], v["complete"], v["failed"], v["running"], round(v["bytes"] / 2**20, 3))
                            for k, v in u["stages"].items()]))
        print()
        print(format_table(["run_id", "artifacts", "MiB", "report MiB"],
                           [(k, v["artifacts"], round(v["bytes"] / 2**20, 3), round(v["report_bytes"] / 2**20, 3))
                            for k, v in u["runs"].items()]))
        for f in u["fleets"]:
            live = [v["version"] for v in f["versions"] if v["live"]]
            print(f"\nfleet {f['root']}: {len(f['versions'])} versions (live {', '.join(live) or 'none'}), "
                  f"{_mib(f['bytes'])}")
        print(f"\nstore {u['store']}: {_mib(u['bytes'])} (catalog {_mib(u['catalog_bytes'])}, "
              f"run reports {_mib(u['reports_bytes'])})")
        emit_json(args, u)
        return 0
    if args.keep < 1:
        raise CartridgeError(f"--keep must be at least 1, got {args.keep}")
    out = prune(store, args.keep, args.fleet, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for root, names in out["versions"].items():
        print(f"fleet {root}: {verb} {len(names)} versions" + (f" ({', '.join(names)})" if names else ""))
    for line in out["skipped_roots"]:
        print(f"skipped (being written): {line}")
    print(f"store {store.root}: {verb} {len(out['artifacts'])} artifacts and {len(out['reports'])} run reports, "
          f"{_mib(out['freed_bytes'])}")
    emit_json(args, out)
    return 0
