"""Where each node of a multi-node server sits and every address that follows from it (the
layout is launch.multinode's; the processes on each node read it to find their sockets)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_DIST_TIMEOUT = 600.0  # TP init (every node loading its model) and any one collective


@dataclass(frozen=True)
class NodePlan:
    """Where this node sits in a multi-node server and every address that follows from it."""

    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"  # node 0's address (resolved: ZeroMQ binds to addresses, not names)
    port: int = 0
    tp_size: int = 1
    dist_timeout: float = DEFAULT_DIST_TIMEOUT

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_ranks(self, node: int | None = None) -> range:
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def is_remote(self, rank: int) -> bool:
        """Whether rank runs on another node than node 0 (its inbox is TCP, not ipc)."""
        return self.multi and self.node_of(rank) != 0

    @property
    def dist_init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def control_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    def inbox_endpoint(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 2 + rank}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> NodePlan:
        return cls(**d) if d else cls()
