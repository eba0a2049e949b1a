"""Relay: an LLM inference engine with continuous batching, a paged KV pool and a radix prefix cache."""

from importlib import metadata

from relay.config import EngineConfig
from relay.outputs import FinishReason, RequestOutput
from relay.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

try:
    __version__ = metadata.version("relay")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it only when asked for, so the
    # lightweight processes (HTTP, tokenizer, scheduler) never pay for that.
    if name == "Engine":
        from relay.engine import Engine

        return Engine
    raise AttributeError(name)
