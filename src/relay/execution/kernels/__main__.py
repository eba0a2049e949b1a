"""`python -m relay.execution.kernels`: build this CPU's kernel library ahead of the first start
(scripts/install.sh runs it), so a server's first start does not wait on the C compiler. The
library goes where every process looks for it (cpu.library_path, under $RELAY_CACHE_DIR)."""

import sys
import time

from relay.execution.kernels import cpu, isa


def main() -> int:
    started = time.perf_counter()
    try:
        path = cpu.build()
    except RuntimeError as e:
        print(
            f"Relay's CPU kernels were not built ({e}); the torch paths will be used",
            file=sys.stderr,
        )
        return 1
    print(f"CPU kernels for {isa.level()}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
