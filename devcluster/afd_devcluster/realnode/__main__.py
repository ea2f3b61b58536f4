"""python -m afd_devcluster.realnode start|stop|status [--state DIR]

start: bring the node up (or find it up), print its admin kubeconfig's path.
stop: drain, stop every daemon, undo the host changes; exit 1 if any remains.
status: the daemons alive now, and what differs from the host record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from afd_devcluster.realnode.hoststate import HostRecord
from afd_devcluster.realnode.node import DAEMONS, RealNode


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m afd_devcluster.realnode",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--state", type=Path, default=None, help="state folder (default $AFD_REALNODE_STATE)")
    args = parser.parse_args()
    node = RealNode(args.state)
    if args.action == "start":
        node.start()
        print(node.kubeconfig)
        return 0
    if args.action == "stop":
        left = node.stop()
        for line in left:
            print(f"left on the host: {line}", file=sys.stderr)
        return 1 if left else 0
    alive = node.running()
    print(f"running: {', '.join(alive) or 'nothing'} ({len(alive)}/{len(DAEMONS)})")
    if node.record_file.exists():
        for line in HostRecord.load(node.record_file).differences():
            print(f"changed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
