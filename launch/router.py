"""sglang-router's CLI as a child of `launch.serve --dp`: the same flags as
`python -m sglang_router.launch_router`, but it dies with the supervisor that started it."""

from __future__ import annotations

import sys


def main() -> int:
    from launch.dp_replicas import replica_setup

    replica_setup()
    try:
        from sglang_router.launch_router import main as router_main
    except ImportError as e:
        print(f"sglang-router is not installed ({e}): pip install sglang-router", file=sys.stderr)
        return 2
    router_main()  # reads sys.argv[1:]; blocks while the router serves
    return 0


if __name__ == "__main__":
    sys.exit(main())
